"""What the chaos clients saw, judged against the contract. Pure: neither grpc nor torch.

    RequestSpec (what a client sends, which answers the contract lets it end with)
        → Outcome (what came back: status, tokens, finish)
    Outcome + the greedy reference of its prompt + the fault's FaultPolicy
        → violations (one line each, alike ones collapsed) and a Tally (counts per status)

The load generator (``chaos_load``) makes outcomes, the checker (``chaos_checker``) and
``bench/soak.py`` judge and count them with this module.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

OK = "OK"
CANCELLED = "CANCELLED"
# Every status a client of the public API may see (docs/design.md "Errors are answers", the README's
# cluster section, inference.proto: ALREADY_EXISTS for a request_id whose call still runs).
# Anything else (UNKNOWN, INTERNAL, DEADLINE_EXCEEDED, ...) is a bug wherever seen.
DOCUMENTED = frozenset({OK, CANCELLED, "INVALID_ARGUMENT", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
                        "ALREADY_EXISTS"})


@dataclass(slots=True, frozen=True)
class RequestSpec:
    """One request a chaos client sends: greedy, ``ignore_eos``, so a finished stream has exactly
    ``max_tokens`` tokens, the first ``max_tokens`` of its prompt's reference."""

    kind: str                                   # what it exercises: "stream", "early-cancel", "flood", ...
    api_key: str
    prompt: str                                 # a name in the prompt book; "" for none (fuzzed requests)
    max_tokens: int
    allowed: frozenset[str] = frozenset({OK})  # how the contract lets it end without any fault
    cancel_after_s: float | None = None         # the client cancels this long after sending
    cancel_after_tokens: int | None = None      # ... or once it holds this many tokens

    def __post_init__(self) -> None:
        unknown = self.allowed - DOCUMENTED
        assert not unknown, f"{self.kind}: {sorted(unknown)} are not documented answers"
        assert CANCELLED not in self.allowed, "CANCELLED is allowed by the client's own cancel only"


@dataclass(slots=True)
class Outcome:
    spec: RequestSpec
    code: str                    # the gRPC status name the client got; OK for a stream that finished
    tokens: list[int]
    finish: str = ""             # "LENGTH", "STOP", "ABORT"; "" when the stream ended without one
    details: str = ""
    sent_at: float = 0.0         # monotonic seconds
    ended_at: float = 0.0
    cancelled: bool = False      # the client cancelled it itself


@dataclass(slots=True, frozen=True)
class FaultPolicy:
    """The answers a fault excuses beyond each request's own ``allowed``: ``excused`` codes, for
    requests alive in the window [start, end] (monotonic seconds), and with ``mid_stream`` False
    only for those that had no token yet (a client can retry those; a lost stream it cannot)."""

    name: str
    why: str                                    # the contract behind the excuse, for the report
    excused: frozenset[str] = frozenset()
    mid_stream: bool = False
    start: float = -math.inf
    end: float = math.inf

    def __post_init__(self) -> None:
        assert self.excused <= DOCUMENTED - {OK, CANCELLED}, f"{self.name}: excuses {sorted(self.excused)}"

    def within(self, start: float, end: float) -> FaultPolicy:
        """The same policy over the window the fault actually lasted."""
        return FaultPolicy(self.name, self.why, self.excused, self.mid_stream, start, end)

    def excuses(self, outcome: Outcome) -> bool:
        overlaps = outcome.sent_at <= self.end and outcome.ended_at >= self.start
        return outcome.code in self.excused and overlaps and (self.mid_stream or not outcome.tokens)


NO_FAULT = FaultPolicy("no fault", "nothing failed: only each request's own answers")


Policies = FaultPolicy | Sequence[FaultPolicy]  # a run with several faults: any one may excuse


def _policies(policy: Policies) -> tuple[FaultPolicy, ...]:
    return (policy,) if isinstance(policy, FaultPolicy) else tuple(policy) or (NO_FAULT,)


def status_violation(outcome: Outcome, policy: Policies = NO_FAULT) -> str | None:
    """Why ``outcome``'s status breaks the contract, or None."""
    spec = outcome.spec
    policies = _policies(policy)
    if outcome.code == CANCELLED:
        if outcome.cancelled:
            return None
        why = "the client did not cancel it"
    elif outcome.code in spec.allowed or any(p.excuses(outcome) for p in policies):
        return None
    elif outcome.code not in DOCUMENTED:
        why = "not a documented status"
    else:
        distinct = {p.name: p for p in policies}.values()
        excuses = "; ".join(f"{p.name} excuses {sorted(p.excused) or 'nothing'}" for p in distinct)
        why = f"allowed {sorted(spec.allowed)}; {excuses}"
    return f"{spec.kind} requests ended {outcome.code} ({why})"


def token_violation(outcome: Outcome, reference: Sequence[int] | None) -> str | None:
    """Why ``outcome``'s tokens are not its prompt's greedy tokens (None when they are): a finished
    stream must hold exactly the first ``max_tokens`` reference tokens, any other a prefix of them.
    A lost token shows as a shift, a duplicated one as a repeat, at the first difference."""
    if reference is None:
        return None
    spec = outcome.spec
    assert len(reference) >= spec.max_tokens, f"reference of {spec.prompt!r} is shorter than {spec.max_tokens}"
    expected = list(reference[: spec.max_tokens])
    got = outcome.tokens
    finished = outcome.code == OK
    if finished and outcome.finish != "LENGTH":
        return (f"{spec.kind} requests finished {outcome.finish or 'without a finish'} "
                f"after {len(got)} of {spec.max_tokens} tokens")
    if got == expected or (not finished and got == expected[: len(got)]):
        return None
    i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    return (f"{spec.kind} requests ({outcome.code}) got other tokens than the reference: {len(got)} tokens "
            f"against {len(expected)}, first difference at {i}: got {got[i:i + 4]}, expected {expected[i:i + 4]}")


def violations(outcomes: Iterable[Outcome], references: Mapping[str, Sequence[int]],
               policy: Policies = NO_FAULT) -> list[str]:
    """Every broken promise among ``outcomes``, alike ones collapsed into one line with a count
    and a first example's details."""
    found: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        for problem in (status_violation(outcome, policy),
                        token_violation(outcome, references.get(outcome.spec.prompt))):
            if problem is not None:
                found.setdefault(problem, []).append(outcome)
    return [f"{len(seen)} × {problem}; e.g. after {len(seen[0].tokens)} tokens: {seen[0].details or '-'}"
            for problem, seen in found.items()]


@dataclass(slots=True)
class Tally:
    """Outcomes counted per (kind, status), for reports."""

    counts: Counter = field(default_factory=Counter)
    tokens: int = 0

    def add(self, outcomes: Iterable[Outcome]) -> None:
        for o in outcomes:
            self.counts[(o.spec.kind, o.code)] += 1
            self.tokens += len(o.tokens)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def per_status(self) -> dict[str, int]:
        out: Counter = Counter()
        for (_, code), n in self.counts.items():
            out[code] += n
        return dict(sorted(out.items()))

    def table(self) -> str:
        """Kinds down, statuses across."""
        codes = sorted({c for _, c in self.counts})
        kinds = sorted({k for k, _ in self.counts})
        width = max([len(k) for k in kinds] + [5])
        lines = [f"{'kind':<{width}} " + " ".join(f"{c:>18}" for c in codes)]
        for k in kinds:
            lines.append(f"{k:<{width}} " + " ".join(f"{self.counts[(k, c)]:>18}" for c in codes))
        lines.append(f"{'all':<{width}} " + " ".join(f"{self.per_status()[c]:>18}" for c in codes))
        return "\n".join(lines)
