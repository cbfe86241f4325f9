"""The restart policy of ``kvfleet up``: backoff, its reset, and giving up on a crash loop."""

from __future__ import annotations

import pytest

from kvfleet.cli.supervisor import RestartPolicy, Restarts


def crash_at_once(backoff: Restarts, times: int, start: float = 0.0) -> list[float]:
    """Start and crash the child ``times`` times, each restart exactly when due; the delays."""
    now, delays = start, []
    for _ in range(times):
        backoff.started(now)
        decision = backoff.exited(now)
        assert decision.restart
        delays.append(decision.delay_s)
        now += decision.delay_s
    return delays


def test_delays_double_from_half_a_second_up_to_the_cap():
    backoff = Restarts(RestartPolicy(max_crashes=100, window_s=1.0))
    assert crash_at_once(backoff, 9) == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.num_restarts == 9


def test_restart_numbers_count_every_restart():
    backoff = Restarts()
    numbers = []
    for t in range(3):
        backoff.started(t * 100.0)
        numbers.append(backoff.exited(t * 100.0 + 1).restart_number)
    assert numbers == [1, 2, 3]


def test_a_child_that_stayed_up_starts_a_new_streak():
    policy = RestartPolicy(stable_after_s=60.0)
    backoff = Restarts(policy)
    assert crash_at_once(backoff, 4) == [0.5, 1, 2, 4]
    backoff.started(100.0)
    assert backoff.exited(100.0 + 59.0).delay_s == 8  # not long enough: the streak goes on
    backoff.started(200.0)
    decision = backoff.exited(200.0 + 60.0)
    assert decision.restart and decision.delay_s == 0.5
    assert decision.restart_number == 6  # the count of restarts is not reset, only the delay


def test_gives_up_after_too_many_crashes_in_the_window():
    backoff = Restarts(RestartPolicy(max_crashes=3, window_s=10.0, initial_delay_s=0.1, max_delay_s=0.1))
    assert crash_at_once(backoff, 3) == [0.1, 0.1, 0.1]
    backoff.started(0.3)
    decision = backoff.exited(0.3)
    assert not decision.restart and decision.crashes_in_window == 4
    assert backoff.num_restarts == 3


def test_crashes_older_than_the_window_do_not_count():
    backoff = Restarts(RestartPolicy(max_crashes=2, window_s=10.0))
    for t in (0.0, 5.0, 11.0, 16.0):  # never more than two within 10 s
        backoff.started(t - 0.5)
        decision = backoff.exited(t)
        assert decision.restart and decision.crashes_in_window <= 2, t
    backoff.started(17.0)
    assert not backoff.exited(17.5).restart  # 11, 16, 17.5: three within 10 s


def test_an_exit_without_a_recorded_start_still_backs_off():
    backoff = Restarts()
    assert [backoff.exited(float(t)).delay_s for t in range(3)] == [0.5, 1, 2]


@pytest.mark.parametrize("bad", [
    dict(initial_delay_s=-1), dict(initial_delay_s=60, max_delay_s=30), dict(factor=0.5),
    dict(stable_after_s=0), dict(window_s=0), dict(max_crashes=0),
])
def test_policy_validates(bad):
    with pytest.raises(ValueError):
        RestartPolicy(**bad)
