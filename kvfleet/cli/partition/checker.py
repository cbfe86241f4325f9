"""The checker of a partition scenario's history (pure: no grpc, no torch).

A history is what the clients saw, with times (``time.monotonic()``):

- ``Write``: one page-table call (``alloc`` or ``release``) sent to one block_service replica, and
  whether that replica acknowledged it. The page-table client sends every call to *both* replicas,
  so the replica that acknowledges is the one accepting writes then, and a refusal ends its term.
- ``Stream``: one Generate call through the router: the tokens received, and the error if it failed.
- ``QuotaSample``: a tenant's charged blocks on a node against its quota, as block_service reported.

The checks (each a count; every one should be 0 but ``unavailable_s``):

- ``lost_acknowledged``: an acknowledged allocation (not acknowledged released) missing after the
  heal, or held with other blocks than the ones granted;
- ``double_grants``: a block granted to a sequence while another live sequence holds it, in the
  acknowledged history or in the state after the heal;
- ``split_brain_writes``: an acknowledgement by one replica inside a term of the other (between two
  of that replica's acknowledgements with no refusal of its own in between);
- ``wrong_tokens``: a streamed token that differs from the fault-free float32 run's, a token lost
  or repeated (a finished stream of another length than the reference's);
- ``over_quota``: a sample with a tenant over its quota;
- ``unavailable_s``: the longer of the page-table client's and the stream clients' time without
  service: every gap of more than its stall threshold between acknowledgements (between tokens,
  over every stream), summed. The threshold is ``STALL_S`` (1 s), plus, where the scenario delays
  what every service sends by ``delay_s`` (``lossy``), that delay once per delayed one-way leg on the
  longest wait the client makes by design (``LEGS``; ``stall_thresholds``):

      page_table  3 legs: leader → standby (replication), standby → leader (its ack), leader →
                  client (the answer; or leader → etcd → leader for the durable mark, then the answer)
      streams     9 legs, a request's wait for its first token: router → block_service →
                  router (prefix lookup), router → node, node → block_service → standby →
                  block_service → node (the prompt's blocks, acknowledged once the standby holds
                  them), node → router → client (the token)

  The client's own sends are never delayed (it runs in the root namespace). The jitter, the loss's
  retransmissions and everything else still fall to the 1 s. The figure at a flat ``STALL_S`` is
  kept as ``unavailable_raw_s`` (and per client), and the thresholds used as ``stall_s``.

Each violation is a ``Finding``: its line, and the records that show it (every write of the sequences
involved), which ``check`` returns as ``violations`` with times from the clients' start and each record's
term (that replica's run of acknowledgements it falls in), so that a failed run can be read afterwards.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

STALL_S = 1.0  # a client not served for longer than this is counted unavailable for the whole gap
LEGS = {"page_table": 3, "streams": 9}  # delayed one-way legs on each client's longest wait (above)
KEYS = ("lost_acknowledged", "double_grants", "split_brain_writes", "wrong_tokens", "over_quota", "unavailable_s")
RAW_KEY = "unavailable_raw_s"  # unavailable_s at a flat STALL_S, summed in the totals too


@dataclass(frozen=True, slots=True)
class Write:
    t_start: float
    t_end: float
    replica: str
    op: str                       # "alloc" or "release"
    seq_id: str
    ok: bool                      # acknowledged
    block_ids: tuple[int, ...] = ()
    error: str = ""               # not acknowledged: the error's class (``NotFound``, ``Unavailable``, ...)


@dataclass(slots=True)
class Stream:
    t_start: float
    t_end: float
    prompt: int                   # index of the prompt (the reference's key)
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # when each chunk with tokens arrived
    error: str | None = None      # None: the stream finished


@dataclass(frozen=True, slots=True)
class QuotaSample:
    t: float
    tenant: str
    node_id: str
    charged: int
    allowed: int | None


@dataclass(frozen=True, slots=True)
class Finding:
    """One violation: its line (``str()``), and the writes that show it."""

    what: str
    records: tuple[Write, ...] = ()

    def __str__(self) -> str:
        return self.what

    def __eq__(self, other: object) -> bool:  # a finding reads as its line
        return str(self) == str(other)

    def __hash__(self) -> int:
        return hash(self.what)


def _touching(writes: Iterable[Write], *seq_ids: str) -> tuple[Write, ...]:
    return tuple(sorted((w for w in writes if w.seq_id in seq_ids), key=lambda w: (w.t_start, w.replica)))


def lost_acknowledged(writes: Iterable[Write], final: Mapping[str, Sequence[int]]) -> list[Finding]:
    """Acknowledged allocations missing, or held with other blocks, in ``final`` (seq id → block ids
    read from the leader after the heal). A release sent to every replica and acknowledged by none
    makes its sequence uncertain (it may have been applied): not counted; unless a replica answered
    it ``NotFound`` (only the leader answers a write so): the sequence was gone before its release."""
    writes = list(writes)
    granted: dict[str, tuple[int, ...]] = {}
    releases: dict[tuple[str, float], bool] = {}
    vanished: set[str] = set()
    for w in sorted(writes, key=lambda w: w.t_end):
        if w.op == "alloc" and w.ok:
            granted[w.seq_id] = w.block_ids
        elif w.op == "release":
            releases[w.seq_id, w.t_start] = releases.get((w.seq_id, w.t_start), False) or w.ok
            if w.error == "NotFound" and w.seq_id in granted:
                vanished.add(w.seq_id)
            if w.ok:
                granted.pop(w.seq_id, None)
    uncertain = {seq_id for (seq_id, _), ok in releases.items() if not ok} - vanished
    return [Finding(s, _touching(writes, s)) for s, blocks in sorted(granted.items())
            if s not in uncertain | vanished and tuple(final.get(s, ())) != blocks] + [
        Finding(f"{s} (its release found it gone)", _touching(writes, s)) for s in sorted(vanished)]


def double_grants(writes: Iterable[Write], final: Mapping[str, Sequence[int]]) -> list[Finding]:
    """Blocks granted while another live sequence held them (acknowledged grants in the order they
    came back), and blocks held by two sequences in ``final``. A release frees its sequence's blocks
    from the moment it was sent, acknowledged or not (one that timed out may have been applied)."""
    writes = list(writes)
    events: list[tuple[float, int, Write]] = [(w.t_end, 1, w) for w in writes if w.op == "alloc" and w.ok]
    events += {(w.seq_id, w.t_start): (w.t_start, 0, w) for w in writes if w.op == "release"}.values()
    holder: dict[int, str] = {}
    held: dict[str, tuple[int, ...]] = {}
    found = []
    for _, _, w in sorted(events, key=lambda e: (e[0], e[1])):
        if w.op == "release":
            for block in held.pop(w.seq_id, ()):
                holder.pop(block, None)
            continue
        for block in w.block_ids:
            other = holder.get(block)
            if other is not None and other != w.seq_id:
                found.append(Finding(f"block {block} granted to {w.seq_id} while {other} held it",
                                     _touching(writes, other, w.seq_id)))
            holder[block] = w.seq_id
        held[w.seq_id] = w.block_ids
    owners: dict[int, str] = {}
    for seq_id, blocks in sorted(final.items()):
        for block in blocks:
            if block in owners:
                found.append(Finding(f"block {block} held by {owners[block]} and {seq_id} after the heal",
                                     _touching(writes, owners[block], seq_id)))
            owners[block] = seq_id
    return found


def _terms(writes: Sequence[Write]) -> list[tuple[float, float]]:
    """One replica's terms as (end of its first acknowledgement, start of its last), a term being a
    run of its acknowledgements with no refusal of its own in between."""
    terms, first, last = [], None, None
    for w in sorted(writes, key=lambda w: w.t_start):
        if w.ok:
            first = w.t_end if first is None else first
            last = w.t_start
        elif first is not None:
            terms.append((first, last))
            first = last = None
    if first is not None:
        terms.append((first, last))
    return terms


def split_brain_writes(writes: Iterable[Write]) -> list[Write]:
    """Acknowledgements by a replica made wholly inside a term of another replica."""
    by_replica: dict[str, list[Write]] = {}
    for w in writes:
        by_replica.setdefault(w.replica, []).append(w)
    terms = {r: _terms(ws) for r, ws in by_replica.items()}
    return [w for r, ws in by_replica.items() for w in ws if w.ok
            and any(lo < w.t_start and w.t_end < hi for other, ts in terms.items() if other != r for lo, hi in ts)]


def wrong_tokens(streams: Iterable[Stream], reference: Mapping[int, Sequence[int]]) -> int:
    """Tokens that differ from the reference's at their position, plus the tokens a finished stream
    lost or repeated (its length against the reference's). A failed stream's tokens must be a prefix
    of the reference: its client saw the error and retries."""
    wrong = 0
    for s in streams:
        ref = reference[s.prompt]
        wrong += sum(1 for got, want in zip(s.tokens, ref) if got != want)
        if s.error is None or len(s.tokens) > len(ref):
            wrong += abs(len(s.tokens) - len(ref))
    return wrong


def over_quota(samples: Iterable[QuotaSample]) -> int:
    return sum(1 for q in samples if q.allowed is not None and q.charged > q.allowed)


def unavailable_s(served: Iterable[float], start: float, end: float, stall_s: float = STALL_S) -> float:
    """Seconds without service for one kind of client: the gaps longer than ``stall_s`` between the
    times it was served (a token arrived, a write was acknowledged), from ``start`` to ``end``."""
    times = [start, *sorted(t for t in served if start <= t <= end), end]
    return sum(b - a for a, b in zip(times, times[1:]) if b - a > stall_s)


def stall_thresholds(delay_s: float = 0.0) -> dict[str, float]:
    """Each client's stall threshold when every service's sends are delayed by ``delay_s``."""
    return {client: STALL_S + legs * delay_s for client, legs in LEGS.items()}


def _outages(writes: Sequence[Write], streams: Sequence[Stream], start: float, end: float,
             stall_s: Mapping[str, float]) -> dict[str, float]:
    served = {"page_table": [w.t_end for w in writes if w.ok], "streams": [t for s in streams for t in s.times]}
    return {client: unavailable_s(times, start, end, stall_s[client]) for client, times in served.items()}


def _split_finding(w: Write, writes: Sequence[Write]) -> Finding:
    """A split-brain acknowledgement with the other replicas' acknowledgements just before and after it."""
    others = sorted((o for o in writes if o.ok and o.replica != w.replica), key=lambda o: o.t_start)
    before = [o for o in others if o.t_end < w.t_start][-1:]
    after = [o for o in others if o.t_start > w.t_end][:1]
    return Finding(f"{w.replica} acked {w.op} {w.seq_id} inside another's term", (*before, w, *after))


def evidence(findings: Iterable[Finding], writes: Sequence[Write], t0: float, limit: int = 10) -> list[dict]:
    """Findings as JSON: each record with its times from ``t0`` and the term of its replica it falls
    in (``[first ack, last ack]`` from ``t0``, None: outside every term of its replica)."""
    terms = {r: _terms([w for w in writes if w.replica == r]) for r in {w.replica for w in writes}}

    def record(w: Write) -> dict:
        term = next(([round(lo - t0, 3), round(hi - t0, 3)] for lo, hi in terms[w.replica]
                     if lo <= w.t_end and w.t_start <= hi), None)
        return {**asdict(w), "t_start": round(w.t_start - t0, 3), "t_end": round(w.t_end - t0, 3), "term": term}

    return [{"what": str(f), "records": [record(w) for w in f.records]} for f in list(findings)[:limit]]


def history_json(writes: Sequence[Write], final: Mapping[str, Sequence[int]], streams: Sequence[Stream],
                 samples: Sequence[QuotaSample], start: float, end: float, **meta) -> dict:
    """Everything a scenario's clients recorded (times as recorded, ``time.monotonic()``), for a file."""
    return {"start": start, "end": end, **meta, "writes": [asdict(w) for w in writes],
            "final": {k: list(v) for k, v in final.items()}, "streams": [asdict(s) for s in streams],
            "quota_samples": [asdict(q) for q in samples]}


def check(writes: Sequence[Write], final: Mapping[str, Sequence[int]], streams: Sequence[Stream],
          reference: Mapping[int, Sequence[int]], samples: Sequence[QuotaSample], start: float, end: float,
          delay_s: float = 0.0) -> dict:
    """Every figure of one scenario (its clients ran from ``start`` to ``end``; ``delay_s``: the delay
    it added to what every service sends), with the first few findings of each kind as examples."""
    lost, doubles, split = lost_acknowledged(writes, final), double_grants(writes, final), split_brain_writes(writes)
    stall_s = stall_thresholds(delay_s)
    outages = _outages(writes, streams, start, end, stall_s)
    raw = _outages(writes, streams, start, end, stall_thresholds())
    return {
        "lost_acknowledged": len(lost),
        "double_grants": len(doubles),
        "split_brain_writes": len(split),
        "wrong_tokens": wrong_tokens(streams, reference),
        "over_quota": over_quota(samples),
        "unavailable_s": round(max(outages.values()), 2),
        "unavailable_by_client_s": {k: round(v, 2) for k, v in outages.items()},
        "stall_s": {k: round(v, 3) for k, v in stall_s.items()},
        RAW_KEY: round(max(raw.values()), 2),
        "unavailable_raw_by_client_s": {k: round(v, 2) for k, v in raw.items()},
        "acknowledged_writes": sum(1 for w in writes if w.ok),
        "streams": len(streams),
        "failed_streams": sum(1 for s in streams if s.error is not None),
        "stream_errors": sorted({s.error for s in streams if s.error is not None})[:3],
        "examples": [*map(str, lost[:3]), *map(str, doubles[:3]),
                     *(f"{w.replica} acked {w.op} {w.seq_id} inside another's term" for w in split[:3])],
        "violations": {"lost_acknowledged": evidence(lost, writes, start),
                       "double_grants": evidence(doubles, writes, start),
                       "split_brain_writes": evidence((_split_finding(w, writes) for w in split), writes, start)},
    }


def totals(results: Mapping[str, Mapping]) -> dict:
    """The top-level figures: each one summed over the scenarios."""
    return {k: round(sum(r.get(k, 0) for r in results.values()), 2) for k in (*KEYS, RAW_KEY)}
