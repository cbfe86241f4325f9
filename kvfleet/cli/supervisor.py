"""When to restart a child process that died: exponential backoff, a reset, and giving up.

A child that crashes at once (a bad flag, a port taken, a peer not up yet) would otherwise be
restarted in a tight loop, filling its log and burning the CPU its siblings need; one that crashes
rarely should come back fast. So each child has its own ``Restarts``, whose delays are
``kvfleet.core.backoff.Backoff``'s (the same pacing every retry of a peer uses):

    delay of restart k (k = 1, 2, ...) in one streak:  min(initial · factor^(k-1), max)
                                                        0.5, 1, 2, 4, ... 30, 30 s by default
    a child that stayed up ``stable_after_s``           ends its streak: the next delay is initial again
    more than ``max_crashes`` exits in ``window_s``     give up: the child is crash-looping

Pure: the caller passes the clock in and does the waiting and the spawning
(``kvfleet.cli.up`` for ``kvfleet up``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvfleet.core.backoff import Backoff


@dataclass(slots=True, frozen=True)
class RestartPolicy:
    initial_delay_s: float = 0.5
    max_delay_s: float = 30.0
    factor: float = 2.0
    stable_after_s: float = 60.0   # up this long: the next crash starts a new streak
    max_crashes: int = 10          # more exits than this within window_s: give up
    window_s: float = 300.0

    def __post_init__(self) -> None:
        self.delays()  # the delays' bounds are Backoff's to check
        if self.stable_after_s <= 0 or self.window_s <= 0:
            raise ValueError(f"stable_after_s and window_s must be > 0, got {self.stable_after_s}, {self.window_s}")
        if self.max_crashes < 1:
            raise ValueError(f"max_crashes must be >= 1, got {self.max_crashes}")

    def delays(self) -> Backoff:
        return Backoff(self.initial_delay_s, self.max_delay_s, self.factor)


@dataclass(slots=True, frozen=True)
class RestartDecision:
    restart: bool        # False: give up on this child
    delay_s: float       # wait this long before starting it again (0 when giving up)
    restart_number: int  # how many times this child will have been restarted, this one included
    crashes_in_window: int


class Restarts:
    """One child's exits → whether and when to start it again. Call ``started`` at each start and
    ``exited`` at each exit; the first start is the one before any restart."""

    def __init__(self, policy: RestartPolicy = RestartPolicy()):
        self.policy = policy
        self.num_restarts = 0
        self._started_at: float | None = None
        self._delays = policy.delays()       # this streak's (reset once the child stayed up stable_after_s)
        self._exits: deque[float] = deque()  # exit times within the window

    def started(self, now: float) -> None:
        self._started_at = now

    def exited(self, now: float) -> RestartDecision:
        policy = self.policy
        if self._started_at is not None and now - self._started_at >= policy.stable_after_s:
            self._delays.reset()
        self._started_at = None
        self._exits.append(now)
        while self._exits and self._exits[0] <= now - policy.window_s:
            self._exits.popleft()
        crashes = len(self._exits)
        if crashes > policy.max_crashes:
            return RestartDecision(False, 0.0, self.num_restarts, crashes)
        self.num_restarts += 1
        return RestartDecision(True, self._delays.next(), self.num_restarts, crashes)
