"""Retrying a peer that is down: capped exponential delays, and a log line now and then. Pure.

    delays:  0.2  0.4  0.8  1.6  3.2  5.0  5.0 ...   (first_s times factor each step, capped at cap_s)

A process that waits for block_service or etcd to come back retries soon at first (a restart
takes seconds) and then at a steady, cheap pace; ``LogThrottle`` keeps the wait to one line every
few seconds instead of one per attempt. ``kvfleet up`` paces the restarts of a crashed child with
the same delays (``kvfleet.cli.supervisor``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Backoff:
    first_s: float = 0.2
    cap_s: float = 5.0
    factor: float = 2.0
    _next_s: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s:
            raise ValueError(f"backoff needs 0 < first_s <= cap_s, got {self.first_s}, {self.cap_s}")
        if self.factor < 1:
            raise ValueError(f"backoff needs factor >= 1, got {self.factor}")
        self._next_s = self.first_s

    def next(self) -> float:
        """The delay before the next attempt (each call multiplies the following one, up to the cap)."""
        delay = self._next_s
        self._next_s = min(self._next_s * self.factor, self.cap_s)
        return delay

    def reset(self) -> None:
        self._next_s = self.first_s


@dataclass(slots=True)
class LogThrottle:
    """``due()`` is True at most once every ``every_s`` seconds (the first time always)."""

    every_s: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _last: float | None = field(init=False, default=None)

    def due(self) -> bool:
        now = self.clock()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        return True


def error_line(error: BaseException) -> str:
    """An error of a peer in one line, for a retry's log: gRPC's details when it has them."""
    details = getattr(error, "details", None)
    text = details() if callable(details) else str(error)
    return (text or type(error).__name__).splitlines()[0]
