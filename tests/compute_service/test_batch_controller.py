"""The P99 batch controller's rule on simulated latency series (pure logic, simulated time)."""

from __future__ import annotations

import random

import pytest

from kvfleet.compute_service.engine.batch_controller import BatchController, ControllerConfig, grown, p99, shrunk

MS = 1e-3


def simulate(itl_of, target_ms=50.0, max_num_seqs=64, demand=1000, seconds=600.0, seed=0, **kw):
    """A node whose every running sequence gets one token per step, and a step of ``n`` sequences
    takes ``itl_of(n)`` seconds (±5% noise); ``demand`` sequences always want to run. Returns the
    cap after each decision and the (time, cap, ITL) of every step."""
    rng = random.Random(seed)
    config = ControllerConfig(target_ms * MS, max_num_seqs, **kw)
    ctl = BatchController(config, now=0.0)
    now, caps, steps = 0.0, [], []
    while now < seconds:
        n = min(ctl.cap, demand)
        itl = itl_of(n) * rng.uniform(0.95, 1.05)
        now += itl
        ctl.observe(now, [itl] * n, n)
        steps.append((now, ctl.cap, itl))
        if ctl.due(now):
            caps.append(ctl.decide(now).cap)
    return caps, steps


def linear(base_ms, per_seq_ms):
    return lambda n: (base_ms + per_seq_ms * n) * MS


def test_integer_steps_of_the_guides_rule():
    assert [shrunk(c) for c in (64, 20, 10, 5, 2, 1)] == [57, 18, 9, 4, 1, 1]
    assert [grown(c, 64) for c in (1, 5, 9, 10, 20, 60, 64)] == [2, 6, 10, 11, 22, 64, 64]
    assert p99([5.0]) == 5.0 and p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 1001)]) == 990.0


def test_converges_into_the_dead_band_and_stays():
    # 10 ms + 2.5 ms per sequence: caps 13-16 give 42.5-50 ms, inside [40, 50] ms
    caps, steps = simulate(linear(10, 2.5))
    assert caps[0] == 57                        # over target at the maximum: ×0.9
    settled = caps[len(caps) // 3:]
    assert len(set(settled)) == 1 and 13 <= settled[0] <= 16, settled
    late = [itl for t, _, itl in steps if t > 200]
    assert p99(late) <= 50 * MS * 1.05          # within the target (plus the plant's own noise)


def test_grows_from_below_to_the_band_and_stays():
    caps, _ = simulate(linear(2, 1), target_ms=30.0)  # caps 22-28 give 24-30 ms
    first = BatchController(ControllerConfig(30 * MS, 64), 0.0)
    assert first.cap == 64
    settled = caps[len(caps) // 3:]
    assert len(set(settled)) == 1 and 22 <= settled[0] <= 28, settled


def test_no_cap_in_the_band_probes_ever_more_rarely():
    """18 ms per sequence: 2 sequences (36 ms) are under the band, 3 (54 ms) over the target. The
    bare rule would flip 2 → 3 → 2 every other interval; the ceiling makes probes of 3 back off."""
    caps, steps = simulate(lambda n: 18 * n * MS, seconds=2000.0)
    assert set(caps[len(caps) // 4:]) <= {2, 3}
    probes = [i for i in range(1, len(caps)) if caps[i] > caps[i - 1]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 64, gaps  # 4, 8, ... 64 intervals apart, then every 64
    assert all(caps[i + 1] == 2 for i in probes if i + 1 < len(caps))  # a failed probe lasts one interval
    over = [t for t, cap, _ in steps if cap == 3 and t > 500]
    assert len(over) / len([s for s in steps if s[0] > 500]) < 0.1


def test_never_below_one_never_above_the_maximum():
    caps, _ = simulate(lambda n: 1.0, max_num_seqs=8, seconds=300.0)  # always 1 s: far over
    assert min(caps) == 1 and caps[-1] == 1
    caps, _ = simulate(lambda n: 1 * MS, max_num_seqs=8, seconds=60.0)  # always far under
    assert set(caps) == {8}


def test_a_cap_nobody_reaches_does_not_grow():
    config = ControllerConfig(50 * MS, 64)
    ctl = BatchController(config, now=0.0)
    t = 0.0
    for _ in range(200):  # over target at 64: cut to 57
        t += 0.1
        ctl.observe(t, [0.1] * 64, 64)
    assert ctl.decide(t).cap == 57
    for _ in range(10):
        for _ in range(50):  # light load: 4 sequences, fast; the cap is never reached
            t += 0.01
            ctl.observe(t, [0.01] * 4, 4)
        assert ctl.decide(t).cap == 57



def test_a_step_that_filled_its_token_budget_reached_the_cap():
    """Long prompts: the step's token budget (which follows the cap) binds before the number of
    sequences does. Fast steps that used it all are evidence for a larger batch: the cap grows."""
    ctl = BatchController(ControllerConfig(50 * MS, 64), now=0.0)
    t = 0.0
    for _ in range(200):  # over target at 64: cut to 57
        t += 0.1
        ctl.observe(t, [0.1] * 64, 64)
    assert ctl.decide(t).cap == 57
    for _ in range(50):  # 20 sequences, fast, each step's budget full of prompt chunks
        t += 0.01
        ctl.observe(t, [0.01] * 20, 20, budget_used_up=True)
    assert ctl.decide(t).cap == 62

def test_too_few_samples_change_nothing():
    ctl = BatchController(ControllerConfig(50 * MS, 16, min_samples=20), now=0.0)
    ctl.observe(1.0, [1.0] * 19, 16)
    decision = ctl.decide(2.0)
    assert decision.p99_s is None and decision.num_samples == 19 and not decision.changed and ctl.cap == 16


def test_a_batch_still_draining_after_a_cut_is_not_judged():
    """After a cut to 9, the 10 sequences already running finish at their pace; their slow steps
    are the old cap's, so no second cut comes until steps run at the new cap."""
    ctl = BatchController(ControllerConfig(50 * MS, 10), now=0.0)
    ctl.observe(1.0, [0.2] * 40, 10)
    assert ctl.decide(2.0).cap == 9
    for second in range(3, 10):
        ctl.observe(second - 0.5, [0.2] * 40, 10)  # still 10 running
        assert ctl.decide(float(second)).cap == 9
    ctl.observe(10.5, [0.2] * 36, 9)
    assert ctl.decide(11.0).cap == 8


def test_old_samples_leave_the_window():
    ctl = BatchController(ControllerConfig(50 * MS, 16, interval_s=2.0, window_s=4.0), now=0.0)
    ctl.observe(0.5, [0.01] * 30, 16)   # fast, reaching the cap: would hold (at the maximum)
    assert ctl.decide(2.0).p99_s == pytest.approx(0.01)
    assert ctl.decide(5.0).p99_s is None  # 4.5 s old: gone


def test_bad_configuration():
    for kw in ({"target_s": 0, "max_num_seqs": 4}, {"target_s": 0.05, "max_num_seqs": 0},
               {"target_s": 0.05, "max_num_seqs": 4, "interval_s": 5, "window_s": 2},
               {"target_s": 0.05, "max_num_seqs": 4, "band": 1.0}):
        with pytest.raises(ValueError):
            ControllerConfig(**kw)
