"""When a delayed chunk of a TCP stream is delivered: each chunk, read at ``t``, waits a delay of its
own (``delay`` ± uniform ``jitter``, never below 0), but never overtakes the chunk read before it, as
bytes on one connection cannot: delivered at ``max(the previous delivery, t + its delay)``.

Pure (no sockets, no clock): the delay proxy (``delay_proxy``) reads the clock and sleeps; here is
only the arithmetic, one ``DelaySchedule`` per direction of each proxied connection.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def next_delivery(previous_s: float, read_s: float, delay_s: float) -> float:
    """When a chunk read at ``read_s`` with ``delay_s`` to wait is delivered, after one delivered
    at ``previous_s`` (``-inf``: none before it)."""
    return max(previous_s, read_s + delay_s)


def delivery_times(read_times: Sequence[float], delays: Sequence[float], previous_s: float = -math.inf) -> list[float]:
    """The delivery times of chunks read at ``read_times`` (in the order read), each with its delay."""
    times = []
    for read_s, delay_s in zip(read_times, delays, strict=True):
        previous_s = next_delivery(previous_s, read_s, delay_s)
        times.append(previous_s)
    return times


class DelaySchedule:
    """One direction of one connection: ``deliver_at(read_s)`` for each chunk, in the order read.
    ``switch_off()`` (the heal) makes every later chunk wait for none but the ones before it."""

    def __init__(self, delay_s: float, jitter_s: float = 0.0, rng: random.Random | None = None) -> None:
        assert delay_s >= 0 and jitter_s >= 0, (delay_s, jitter_s)
        self.delay_s = delay_s
        self.jitter_s = jitter_s
        self.rng = rng or random.Random()
        self.last_s = -math.inf  # the latest delivery handed out; deliveries never go below it

    def sample(self) -> float:
        """One chunk's delay: uniform in [delay - jitter, delay + jitter], clipped at 0."""
        if not self.jitter_s:
            return self.delay_s
        return max(0.0, self.delay_s + self.rng.uniform(-self.jitter_s, self.jitter_s))

    def deliver_at(self, read_s: float) -> float:
        self.last_s = next_delivery(self.last_s, read_s, self.sample())
        return self.last_s

    def switch_off(self) -> None:
        self.delay_s = self.jitter_s = 0.0
