"""Retry pacing: capped doubling, and a log line at most every few seconds."""

from __future__ import annotations

import pytest

from kvfleet.core.backoff import Backoff, LogThrottle


def test_delays_double_up_to_the_cap_and_reset():
    backoff = Backoff(0.2, 5.0)
    assert [backoff.next() for _ in range(8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    backoff.reset()
    assert backoff.next() == 0.2


def test_a_factor_other_than_two_paces_the_same_way():
    backoff = Backoff(0.5, 30.0, factor=3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.5, 4.5, 13.5, 30.0]


@pytest.mark.parametrize("first, cap, factor", [(0, 1, 2), (-1, 1, 2), (2, 1, 2), (1, 2, 0.5)])
def test_bad_bounds_are_refused(first, cap, factor):
    with pytest.raises(ValueError, match="backoff"):
        Backoff(first, cap, factor)


def test_log_throttle_lets_one_line_through_per_period():
    now = [100.0]
    throttle = LogThrottle(5.0, clock=lambda: now[0])
    seen = []
    for t in (100.0, 101.0, 104.9, 105.0, 106.0, 111.0):
        now[0] = t
        seen.append(throttle.due())
    assert seen == [True, False, False, True, False, True]
