"""How fast a process's memory grows once warm: MiB per hour from a least-squares line through its
samples after the warm-up, so that a leak reads as one number instead of a table.

A process that was restarted during the run (a fault, a supervisor) is a new process: only the
samples of its last pid count, and its warm-up starts again at its first sample:

    pid 41  ●──●──●──●──●                    (dropped: a process that is gone)
    pid 97                 ●──●──●──●──●──●
                           └ warm-up ┘└ fit ┘

A slope needs ``MIN_SAMPLES`` points after the warm-up; with fewer there is no figure, and the
reason says why.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvfleet.cli.loadgen.analysis import linear_fit

MIN_SAMPLES = 3  # a line through two points is their difference; a third gives the fit something to fit
HOUR_S = 3600.0


@dataclass(slots=True, frozen=True)
class Slope:
    mib_per_hour: float | None  # None: too few samples after the warm-up (``reason`` says)
    samples: int                # in the fit
    span_s: float               # first to last fitted sample
    reason: str = ""

    def text(self) -> str:
        return f"{self.mib_per_hour:+.1f}" if self.mib_per_hour is not None else "-"


def fit_after(points: Sequence[tuple[float, float | None]], from_s: float) -> Slope:
    """The slope of ``(seconds, MiB)`` points at ``from_s`` or later (None values: not read)."""
    kept = [(t, v) for t, v in points if t >= from_s and v is not None]
    if len(kept) < MIN_SAMPLES:
        return Slope(None, len(kept), 0.0, f"{len(kept)} samples after the warm-up, {MIN_SAMPLES} needed")
    xs, ys = [t for t, _ in kept], [v for _, v in kept]
    span = xs[-1] - xs[0]
    if span <= 0:
        return Slope(None, len(kept), 0.0, "the samples after the warm-up share one time")
    slope, _ = linear_fit(xs, ys)
    return Slope(slope * HOUR_S, len(kept), span)


def rss_slope(samples: Sequence[tuple[float, int, float | None]], warmup_s: float) -> Slope:
    """One process's ``(seconds since the run started, pid, MiB)`` samples in time order: the
    slope of its last pid's samples from ``warmup_s`` after that pid's first sample on."""
    if not samples:
        return Slope(None, 0, 0.0, "no samples")
    last_pid = samples[-1][1]
    mine = [(t, mib) for t, pid, mib in samples if pid == last_pid]
    return fit_after(mine, mine[0][0] + warmup_s)


def worst(slopes: Mapping[str, Slope]) -> tuple[str, float] | None:
    """(process, MiB/h) of the steepest fitted slope; None when no process has one."""
    fitted = {name: s.mib_per_hour for name, s in slopes.items() if s.mib_per_hour is not None}
    if not fitted:
        return None
    name = max(fitted, key=fitted.__getitem__)
    return name, fitted[name]
