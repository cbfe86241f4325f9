"""A fixed-bucket latency histogram that a service's own code keeps and its metrics read at scrape
time (``metric_families.histogram``), for figures observed where no Prometheus object should live
(the compute engine's step thread). Pure: seconds are passed in.

Buckets are ``LATENCY_BUCKETS`` unless given; the last bucket is ``+Inf``.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass

from kvfleet.core.metrics_server import LATENCY_BUCKETS


@dataclass(slots=True, frozen=True)
class HistogramSnapshot:
    buckets: tuple[tuple[float, int], ...]  # (upper bound, observations at or below it), the last +inf
    sum: float

    @property
    def count(self) -> int:
        return self.buckets[-1][1]


class LatencyHistogram:
    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS):
        if not bounds or any(b <= a for a, b in zip(bounds, bounds[1:])) or bounds[0] <= 0:
            raise ValueError(f"histogram bounds must be positive and increasing, got {bounds}")
        self.bounds = tuple(bounds)
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        """One observation (a negative one, from clocks of different sources, counts as 0)."""
        seconds = max(seconds, 0.0)
        self._counts[bisect_left(self.bounds, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        cumulative, total = [], 0
        for bound, n in zip((*self.bounds, math.inf), self._counts):
            total += n
            cumulative.append((bound, total))
        return HistogramSnapshot(tuple(cumulative), self._sum)
