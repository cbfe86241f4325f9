"""How many steps before its need a reserve top-up must go so that its answer is back in time. Pure.

A top-up rides the write-behind ``ApplyMany``; the engine decodes a token a step meanwhile. On a
link whose round trip is several steps long, a top-up sent ``TOPUP_MARGIN`` steps ahead comes back
after its sequence crossed the boundary, and that step waits on block_service. So the lead is time,
not steps: the bridge measures its ``ApplyMany`` round trip (from the step that asked it to go,
so a flush in flight before it counts too) and the engine's step (``Pace``, decayed means), and a
top-up goes ``lead_steps`` steps earlier than the margin:

    lead = ceil(LEAD_ROUND_TRIPS · round_trip / step)        (0 until both were measured)

``LEAD_ROUND_TRIPS`` round trips, not one: the round trip jitters, and a top-up may queue behind a
flush in flight. A top-up is queued when its sequence is handed a reserve block and goes no earlier
than the end of that step: when the margin and the lead are longer than a block's decoding, the
sequence keeps ``reserve_blocks`` blocks ahead instead of one (a top-up a block, never one a token).
The step is the engine's ``begin_step`` to ``end_step``, a step that waited on block_service left
out: a lower bound of the time between steps, so the lead errs early.
"""

from __future__ import annotations

import math

from kvfleet.core.decayed_rate import DecayedRate

LEAD_ROUND_TRIPS = 2     # a top-up's answer is wanted this many measured round trips before its need
PACE_HALF_LIFE = 16      # observations: older round trips and steps count half after this many more
MAX_RESERVE_BLOCKS = 4   # the most blocks a sequence holds past those handed to the engine


def lead_steps(round_trip_s: float | None, step_s: float | None) -> int:
    """Steps a top-up must go earlier than ``TOPUP_MARGIN`` for an answer ``round_trip_s`` away,
    at ``step_s`` a step; 0 when either is not known."""
    if not round_trip_s or not step_s:
        return 0
    return math.ceil(LEAD_ROUND_TRIPS * round_trip_s / step_s)


def reserve_blocks(steps: int, block_size: int) -> int:
    """Reserve blocks a sequence needs so that a top-up queued when a block is handed over (the
    earliest it can go) still comes ``steps`` steps before the table runs out: one, unless those
    steps are more than a block's decoding (up to ``MAX_RESERVE_BLOCKS``)."""
    return min(MAX_RESERVE_BLOCKS, max(1, -(-(steps + 1) // block_size)))


class Pace:
    """Decayed means of the bridge's ``ApplyMany`` round trip and of the engine's step, in seconds."""

    def __init__(self, half_life: float = PACE_HALF_LIFE) -> None:
        self._round_trips = DecayedRate(half_life)  # round trips per second of round trip
        self._steps = DecayedRate(half_life)

    def round_trip(self, seconds: float) -> None:
        self._round_trips.observe(1, seconds)

    def step(self, seconds: float) -> None:
        self._steps.observe(1, seconds)

    def lead_steps(self) -> int:
        return lead_steps(_mean(self._round_trips), _mean(self._steps))


def _mean(rate: DecayedRate) -> float | None:
    per_s = rate.per_s
    return 1 / per_s if per_s else None
