"""What the figures mean: where the fixed phase stops stepping up, and whether a soak drifts.

**Stopping the fixed phase.** Concurrency goes up by the same step each time, and stops after the
first step that shows one of, in this order:

    refusals   a request ended with a status other than OK or DEADLINE_EXCEEDED
    timeouts   a request ran past the client's deadline (DEADLINE_EXCEEDED)
    knee       p99 TTFT above ``knee_factor`` × the first step's p99 TTFT (latency has left the
               flat part of the curve: requests wait for each other's prefill), or tokens/s up by
               less than ``min_gain`` over the previous step (more clients, no more throughput)

**Drift.** A least-squares line through a series' samples after the warm-up (the first
``warmup_share`` of the run). Its rise over the window, slope × span, is flagged as drift when it
exceeds ``tolerance`` × the series' reference (a process's RSS: its mean; blocks in use: the pools'
size), so steady noise passes and a leak that grows with time does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.cli.loadgen.records import PhaseStats

DEADLINE = "DEADLINE_EXCEEDED"


@dataclass(slots=True, frozen=True)
class StopRule:
    knee_factor: float = 4.0
    min_gain: float = 0.05

    def __post_init__(self):
        if self.knee_factor <= 1:
            raise ValueError(f"--knee must be above 1, got {self.knee_factor}")
        if self.min_gain < 0:
            raise ValueError(f"--min-gain must be 0 or more, got {self.min_gain}")

    def reason(self, steps: Sequence[PhaseStats]) -> str | None:
        """Why to stop after the last of ``steps`` (None: step up again)."""
        last = steps[-1]
        refused = {code: n for code, n in last.refusals.items() if code != DEADLINE}
        if refused:
            return "refusals: " + ", ".join(f"{code} {n}" for code, n in sorted(refused.items()))
        if last.refusals.get(DEADLINE):
            return f"timeouts: {last.refusals[DEADLINE]} requests past the deadline"
        first_ttft, ttft = steps[0].ttft_s["p99"], last.ttft_s["p99"]
        if len(steps) > 1 and first_ttft and ttft and ttft > self.knee_factor * first_ttft:
            return f"knee: p99 TTFT {ttft:.3f}s > {self.knee_factor:g} x the first step's {first_ttft:.3f}s"
        if len(steps) > 1 and last.tokens_per_s < (1 + self.min_gain) * steps[-2].tokens_per_s:
            return (f"knee: {last.tokens_per_s:.1f} tokens/s, less than {self.min_gain:.0%} above the previous "
                    f"step's {steps[-2].tokens_per_s:.1f}")
        return None


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line; slope 0 for fewer than two distinct xs."""
    n = len(xs)
    if n < 2:
        return 0.0, (ys[0] if ys else 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, my
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


@dataclass(slots=True, frozen=True)
class Drift:
    series: str
    slope_per_min: float   # units of the series per minute
    rise: float            # slope × the fitted window
    reference: float
    flagged: bool
    samples: int

    def line(self) -> str:
        mark = "DRIFT" if self.flagged else "steady"
        return (f"{self.series}: {mark} ({self.slope_per_min:+.3g}/min, {self.rise:+.3g} over the window, "
                f"reference {self.reference:.3g}, {self.samples} samples)")


def drift(series: str, times_s: Sequence[float], values: Sequence[float], reference: float | None = None,
          warmup_share: float = 0.25, tolerance: float = 0.05) -> Drift:
    """``reference`` None: the mean of the fitted samples."""
    assert len(times_s) == len(values)
    if not times_s:
        return Drift(series, 0.0, 0.0, reference or 0.0, False, 0)
    start = times_s[0] + warmup_share * (times_s[-1] - times_s[0])
    kept = [(t, v) for t, v in zip(times_s, values) if t >= start]
    xs, ys = [t for t, _ in kept], [v for _, v in kept]
    slope, _ = linear_fit(xs, ys)
    rise = slope * (xs[-1] - xs[0])
    ref = reference if reference is not None else sum(ys) / len(ys)
    flagged = len(kept) >= 3 and rise > tolerance * max(ref, 1e-9)
    return Drift(series, slope * 60, rise, ref, flagged, len(kept))
