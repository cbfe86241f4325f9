"""What came back: one ``RequestRecord`` per request, and a phase's figures computed from them.

Latencies are the client's, measured from the moment the request was sent:

    sent ──── TTFT ────▶ first tokens ── itl ──▶ tokens ── itl ──▶ … last tokens ──▶ end
    └───────────────────────────────── end-to-end ─────────────────────────────────────┘

A chunk carrying n tokens that arrives dt after the previous one counts n inter-token gaps of dt/n,
the router's own rule (``kvfleet/router/metrics.py``), so the two sides' figures are comparable.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

OK = "OK"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class RequestRecord:
    phase: str
    step: int                   # concurrency of the step (fixed), or of the phase
    prompt_tokens: int          # sent
    max_tokens: int
    sent_at: float              # seconds since the bench started
    status: str = OK            # a gRPC status name; OK when the stream finished
    ended_at: float = math.nan
    ttft_s: float = math.nan
    completion_tokens: int = 0  # tokens received
    usage_prompt_tokens: int = -1  # as the router counted them (-1: no usage came)
    usage_completion_tokens: int = -1
    finish: str = ""
    itl_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def e2e_s(self) -> float:
        return self.ended_at - self.sent_at

    def row(self) -> dict:
        """The CSV row: everything but the gap list, which is summarised."""
        d = asdict(self)
        gaps = d.pop("itl_s")
        d["e2e_s"] = self.e2e_s
        d["itl_mean_s"] = sum(gaps) / len(gaps) if gaps else math.nan
        return d


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 by the nearest-rank rule; None for an empty sample."""
    data = sorted(v for v in values if not math.isnan(v))
    out: dict[str, float | None] = {}
    for q in QUANTILES:
        key = f"p{round(q * 100)}"
        out[key] = data[min(len(data) - 1, max(0, math.ceil(q * len(data)) - 1))] if data else None
    return out


@dataclass(slots=True, frozen=True)
class PhaseStats:
    """A set of requests' figures (a fixed step, or a whole phase)."""

    requests: int
    completed: int
    wall_s: float
    output_tokens: int
    prompt_tokens: int
    tokens_per_s: float        # generated tokens per second of wall time
    requests_per_s: float
    ttft_s: dict
    itl_s: dict
    e2e_s: dict
    refusals: dict[str, int]   # status name → count, OK excluded

    def to_json(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], wall_s: float) -> PhaseStats:
    done = [r for r in records if r.ok]
    out = sum(r.completion_tokens for r in records)
    wall = max(wall_s, 1e-9)
    return PhaseStats(
        requests=len(records), completed=len(done), wall_s=wall_s, output_tokens=out,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        tokens_per_s=out / wall, requests_per_s=len(done) / wall,
        ttft_s=quantiles([r.ttft_s for r in done]),
        itl_s=quantiles([g for r in done for g in r.itl_s]),
        e2e_s=quantiles([r.e2e_s for r in done]),
        refusals=dict(Counter(r.status for r in records if not r.ok)),
    )
