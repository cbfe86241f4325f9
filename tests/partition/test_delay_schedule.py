"""The delay proxy's schedule: a chunk waits its own delay but never overtakes the one read before it;
jitter stays within its bounds; switched off, a chunk waits only for those ahead of it."""

from __future__ import annotations

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from kvfleet.cli.partition.delay_schedule import DelaySchedule, delivery_times, next_delivery

gaps = st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=40)
waits = st.lists(st.floats(0, 5, allow_nan=False), min_size=40, max_size=40)


@given(gaps, waits)
def test_each_chunk_waits_its_delay_and_keeps_its_place(read_gaps, delays):
    reads = [sum(read_gaps[: i + 1]) for i in range(len(read_gaps))]
    delays = delays[: len(reads)]
    times = delivery_times(reads, delays)
    assert all(t >= r + d for t, r, d in zip(times, reads, delays))   # its own delay at least
    assert times == sorted(times)                                       # never before the one ahead
    for i, t in enumerate(times):  # and no later than needed: its own delay, or the one ahead's delivery
        assert t == reads[i] + delays[i] or (i > 0 and t == times[i - 1])


def test_a_short_delay_behind_a_long_one_waits_for_it():
    assert delivery_times([0.0, 0.01, 0.5], [0.3, 0.1, 0.1]) == [0.3, 0.3, 0.6]
    assert next_delivery(-math.inf, 2.0, 0.25) == 2.25


def test_jitter_stays_within_its_bounds_and_varies():
    schedule = DelaySchedule(0.2, 0.1, random.Random(3))
    samples = [schedule.sample() for _ in range(2000)]
    assert all(0.1 <= s <= 0.3 for s in samples)
    assert min(samples) < 0.12 and max(samples) > 0.28  # spread over the whole range, not a constant
    assert DelaySchedule(0.05, 0.2, random.Random(1)).sample() >= 0.0  # clipped at 0, never negative


def test_the_same_seed_gives_the_same_schedule():
    one, two = (DelaySchedule(0.2, 0.1, random.Random(5)) for _ in range(2))
    assert [one.deliver_at(i * 0.01) for i in range(50)] == [two.deliver_at(i * 0.01) for i in range(50)]


def test_switched_off_a_chunk_waits_only_for_those_ahead():
    schedule = DelaySchedule(0.2, 0.1, random.Random(9))
    ahead = schedule.deliver_at(1.0)
    assert ahead >= 1.1
    schedule.switch_off()
    assert schedule.deliver_at(1.0) == ahead         # still behind the one read before it
    assert schedule.deliver_at(ahead + 1.0) == ahead + 1.0
