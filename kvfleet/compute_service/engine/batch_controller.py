"""The P99 batch controller: a node's live cap on running sequences, steered by its tail latency.

Every control interval the node's p99 inter-token latency (ITL) over a sliding window is set
against a target, and the cap moves by the field guide's rule, in whole sequences:

    p99 > target                                cap ← max(1, min(cap − 1, ⌊0.9 · cap⌋))
    p99 < target · (1 − band), and cap reached   cap ← min(max_num_seqs, max(cap + 1, ⌊1.1 · cap⌋))
    otherwise                                   unchanged (the dead band, or a cap nobody reached)

Why the extra conditions, each against a way such a loop goes wrong:

- **Dead band.** Integer steps around a target overshoot both ways; between ``target · (1 − band)``
  and the target the cap holds, so a cap whose p99 lands there stays put.
- **Each decision judges the cap it set.** Only samples taken while at most ``cap`` sequences ran
  count: a cut does not stop the sequences already running, and their steps are the old cap's.
  Until ``min_samples`` such samples exist, nothing moves (a cut is not cut again before it could
  act). A growth empties the window: what smaller batches measured says nothing about a larger one.
- **A window of many steps.** Every token of one step shares its latency, so a p99 over fewer than
  ~100 steps is the slowest step's, and one stall (a busy neighbour on a shared host, a long
  prefill chunk) would cut the cap; the default window is 10 intervals.
- **No growth that nothing used.** A cap that no step reached says nothing about a larger batch
  (light load); growing it anyway would leave it at the maximum when a burst comes. A step that
  filled its token budget reached the cap too: the scheduler's budget follows the cap, and under
  long prompts the budget, not the number of sequences, is what binds.
- **A ceiling after a cut.** When no cap lands in the dead band (cap c is too fast, c + 1 too
  slow), the rule alone cycles c → c + 1 → c every two intervals. After a cut from c, growth
  stops at c − 1 for ``probe_intervals`` intervals, doubling each time a probe of c fails again
  (up to ``max_probe_intervals``): the tail is spent over the target a vanishing share of the time.

Pure logic: time is passed in; nothing here sleeps or reads a clock.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

SHRINK = 0.9
GROW = 1.1


@dataclass(slots=True, frozen=True)
class ControllerConfig:
    target_s: float                 # p99 ITL to hold the node at
    max_num_seqs: int               # the cap never grows past the node's configured maximum
    interval_s: float = 2.0         # between decisions
    window_s: float = 20.0          # samples older than this are forgotten
    band: float = 0.2               # dead band below the target, as a share of it
    min_samples: int = 20           # fewer samples of the current cap: no decision
    probe_intervals: int = 4        # intervals before growing back to a cap that was cut
    max_probe_intervals: int = 64

    def __post_init__(self) -> None:
        if not self.target_s > 0:
            raise ValueError(f"p99 ITL target must be positive, got {self.target_s} s")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if not self.interval_s > 0 or self.window_s < self.interval_s:
            raise ValueError(f"need 0 < interval ({self.interval_s} s) <= window ({self.window_s} s)")
        if not 0 <= self.band < 1:
            raise ValueError(f"dead band must be in [0, 1), got {self.band}")
        if self.min_samples < 1 or not 1 <= self.probe_intervals <= self.max_probe_intervals:
            raise ValueError(f"bad controller limits: {self}")


@dataclass(slots=True, frozen=True)
class Decision:
    at: float
    p99_s: float | None   # None: too few samples of the current cap to judge it
    num_samples: int
    old_cap: int
    cap: int

    @property
    def changed(self) -> bool:
        return self.cap != self.old_cap


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile (a value that occurred, never an interpolation)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.99 * len(ordered)) - 1, 0)]


def shrunk(cap: int) -> int:
    return max(1, min(cap - 1, math.floor(SHRINK * cap)))


def grown(cap: int, limit: int) -> int:
    return min(limit, max(cap + 1, math.floor(GROW * cap)))


class BatchController:
    def __init__(self, config: ControllerConfig, now: float):
        self.config = config
        self.cap = config.max_num_seqs
        self._samples: deque[tuple[float, float, int]] = deque()  # (time, ITL, sequences running)
        self._reached = False           # a step since the last change ran ``cap`` sequences
        self._next_at = now + config.interval_s
        self._ceiling: int | None = None  # a cap that was cut for its tail; growth stays below it
        self._ceiling_until = 0.0
        self._probe_intervals = config.probe_intervals

    def observe(self, now: float, itls: list[float], num_running: int, budget_used_up: bool = False) -> None:
        """One engine step: the gaps before the tokens it produced, with ``num_running`` sequences
        running; ``budget_used_up`` when its tokens filled the step's budget (which follows the cap).
        A step that ran more sequences than the cap (a batch still draining after a cut) says
        nothing about the cap."""
        if num_running >= self.cap or budget_used_up:
            self._reached = True
        self._samples.extend((now, x, num_running) for x in itls)

    def due(self, now: float) -> bool:
        return now >= self._next_at

    def decide(self, now: float) -> Decision:
        """The decision for the interval ending ``now`` (call when ``due``)."""
        cfg = self.config
        self._next_at = now + cfg.interval_s
        while self._samples and self._samples[0][0] < now - cfg.window_s:
            self._samples.popleft()
        old = self.cap
        judged = [x for _, x, n in self._samples if n <= old]
        if len(judged) < cfg.min_samples:
            return Decision(now, None, len(judged), old, old)
        tail = p99(judged)
        if tail > cfg.target_s:
            self._cut(old, now)
        elif tail < cfg.target_s * (1 - cfg.band) and self._reached:
            limit = cfg.max_num_seqs
            if self._ceiling is not None and now < self._ceiling_until:
                limit = min(limit, self._ceiling - 1)
            self.cap = max(old, grown(old, limit))
            if self.cap != old:
                self._samples.clear()
        if self.cap != old:
            self._reached = False
        return Decision(now, tail, len(judged), old, self.cap)

    def _cut(self, old: int, now: float) -> None:
        self.cap = shrunk(old)
        if self.cap == old:
            return  # already at 1
        if self._ceiling == old:  # the probe of this cap failed again: wait longer next time
            self._probe_intervals = min(2 * self._probe_intervals, self.config.max_probe_intervals)
        else:
            self._probe_intervals = self.config.probe_intervals
        self._ceiling = old
        self._ceiling_until = now + self._probe_intervals * self.config.interval_s
