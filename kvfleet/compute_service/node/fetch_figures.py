"""What a node counts of its peer fetches (``prefix_fetch.py``), for its metrics to read. Pure."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvfleet.core.latency_histogram import HistogramSnapshot, LatencyHistogram

FETCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class FetchFigures:
    """What the metrics read: fetches done and why prefixes were prefilled instead."""

    blocks: int = 0                  # imported from peers
    bytes: int = 0
    in_flight: int = 0               # fetches under way now
    decisions: Counter[str] = field(default_factory=Counter)  # fetch, cost, small, off (per request a peer held more)
    fallbacks: Counter[str] = field(default_factory=Counter)  # by reason: part or all of a planned fetch recomputed
    seconds: LatencyHistogram = field(default_factory=lambda: LatencyHistogram(FETCH_BUCKETS))

    def reading(self) -> FetchReading:
        """The figures now, for the metrics thread to read while the loop counts on."""
        return FetchReading(self.blocks, self.bytes, self.in_flight, dict(self.decisions), dict(self.fallbacks),
                            self.seconds.snapshot())


@dataclass(slots=True, frozen=True)
class FetchReading:
    blocks: int
    bytes: int
    in_flight: int
    decisions: dict[str, int]
    fallbacks: dict[str, int]
    seconds: HistogramSnapshot
