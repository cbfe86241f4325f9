"""The block-size search of ``kvfleet tune``, pure: what to measure next, and which size wins.

**Objective.** A run gives generated tokens/s and p99 inter-token latency. A candidate's figures
are the means over its runs; its score is ``(within the SLO, tokens/s)`` when its p99 is within
``slo_ms`` and ``(False, -p99)`` when not, compared as tuples: any size that meets the SLO beats
any that does not, the fastest of those wins, and among sizes that all miss it the one closest to
meeting it ranks first, so the search still walks toward feasibility.

**Search.** The field guide says binary search; but bisection needs a sign (which side is better),
and a noisy unimodal objective gives it only by comparing two interior points. So this is a
golden-section search on the index of the log₂ grid (64, 128, …, 1024): keep a bracket
``[lo, hi]``, compare the points at 0.382 and 0.618 of it, drop the part beyond the worse one,
until three points or fewer remain; then measure those and take the best. Each point is measured
once per ``repeats`` (noise averages down as 1/√repeats), and never twice by the search (memoised).
On the five-point grid that is 3 or 4 sizes measured instead of 5; on a finer grid the saving grows
like log(n). Then the best two are measured ``confirm`` more times each, on fresh clusters, and the
winner is the better of them over all its runs: one lucky run cannot crown a size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

GOLDEN = 0.381966  # 1 - 1/φ


@dataclass(slots=True, frozen=True)
class Run:
    block_size: int
    stage: str             # baseline, search, confirm
    tokens_per_s: float
    p99_itl_ms: float      # nan when no request finished
    completed: int
    requests: int


@dataclass(slots=True)
class Candidate:
    block_size: int
    runs: list[Run] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens_per_s for r in self.runs) / len(self.runs)

    @property
    def p99_itl_ms(self) -> float:
        return sum(r.p99_itl_ms for r in self.runs) / len(self.runs)

    def within(self, slo_ms: float) -> bool:
        """Every request finished and the mean p99 meets the SLO (NaN never does)."""
        return all(r.completed == r.requests for r in self.runs) and self.p99_itl_ms <= slo_ms

    def score(self, slo_ms: float) -> tuple[bool, float]:
        ok = self.within(slo_ms)
        if ok:
            return True, self.tokens_per_s
        p99 = self.p99_itl_ms
        return False, -p99 if p99 == p99 else float("-inf")


def log2_grid(low: int, high: int) -> list[int]:
    """Powers of two from ``low`` to ``high``, both included (both must be powers of two)."""
    for v in (low, high):
        if v < 1 or v & (v - 1):
            raise ValueError(f"block sizes must be powers of two, got {v}")
    if low > high:
        raise ValueError(f"the grid's low end {low} is above its high end {high}")
    out, v = [], low
    while v <= high:
        out.append(v)
        v *= 2
    return out


def golden_section(n: int, better: Callable[[int, int], bool]) -> tuple[int, int]:
    """The bracket ``(lo, hi)`` of at most three indices of ``range(n)`` left by golden-section
    steps; ``better(i, j)`` says whether index i scores above index j (it measures as needed)."""
    lo, hi = 0, n - 1
    while hi - lo > 2:
        a = lo + max(1, round(GOLDEN * (hi - lo)))
        b = max(a + 1, hi - max(1, round(GOLDEN * (hi - lo))))
        if better(b, a):
            lo = a   # the peak is not left of a (a scored below b)
        else:
            hi = b   # nor right of b
    return lo, hi


class Search:
    """Drives the measurements: ``measure(block_size, stage) -> Run`` is the caller's (a fresh
    cluster per call)."""

    def __init__(self, grid: Sequence[int], slo_ms: float, measure: Callable[[int, str], Run],
                 repeats: int = 1, confirm: int = 1):
        if repeats < 1 or confirm < 0:
            raise ValueError(f"--repeats must be at least 1 and --confirm 0 or more, got {repeats}, {confirm}")
        if slo_ms <= 0:
            raise ValueError(f"--slo-ms must be positive, got {slo_ms}")
        if not grid:
            raise ValueError("no block size to search")
        self.grid = list(grid)
        self.slo_ms = slo_ms
        self.measure = measure
        self.repeats = repeats
        self.confirm = confirm
        self.candidates: dict[int, Candidate] = {}
        self.order: list[int] = []   # block sizes in the order the search measured them

    def candidate(self, block_size: int) -> Candidate:
        """Measured ``repeats`` times the first time it is asked for; memoised after."""
        if block_size not in self.candidates:
            c = self.candidates[block_size] = Candidate(block_size)
            self.order.append(block_size)
            for _ in range(self.repeats):
                c.runs.append(self.measure(block_size, "search"))
        return self.candidates[block_size]

    def _better(self, i: int, j: int) -> bool:
        return self.candidate(self.grid[i]).score(self.slo_ms) > self.candidate(self.grid[j]).score(self.slo_ms)

    def run(self) -> Candidate:
        lo, hi = golden_section(len(self.grid), self._better)
        for i in range(lo, hi + 1):
            self.candidate(self.grid[i])
        finalists = self.ranked()[:2]
        for c in finalists:
            for _ in range(self.confirm):
                c.runs.append(self.measure(c.block_size, "confirm"))
        return max(finalists, key=lambda c: c.score(self.slo_ms))

    def ranked(self) -> list[Candidate]:
        """Every measured candidate, best first."""
        return sorted(self.candidates.values(), key=lambda c: c.score(self.slo_ms), reverse=True)
