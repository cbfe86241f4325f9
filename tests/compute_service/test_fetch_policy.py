"""The fetch-or-prefill decision and the rates it weighs (pure)."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.engine.prefill_rate import PrefillRate
from kvfleet.compute_service.node.fetch_policy import FetchCost, FetchPlan, KvFetchSettings
from kvfleet.core.decayed_rate import DecayedRate
from kvfleet.core.settings import SettingError

BLOCK, BYTES = 16, 16 * 23_040  # SmolLM2-135M in bfloat16: 23,040 bytes a token


def test_a_decayed_rate_follows_what_it_measures_now():
    rate = DecayedRate(half_life=100)
    assert rate.per_s is None
    rate.observe(100, 1.0)
    assert rate.per_s == pytest.approx(100)
    for _ in range(20):  # the machine got four times faster
        rate.observe(100, 0.25)
    assert rate.per_s == pytest.approx(400, rel=0.01)
    rate.observe(0, 1.0)
    rate.observe(5, 0)  # nothing measured: nothing changes
    assert rate.observations == 21 and rate.per_s == pytest.approx(400, rel=0.01)
    cut_up, whole = DecayedRate(100), DecayedRate(100)
    for _ in range(10):
        cut_up.observe(10, 0.1)
    whole.observe(100, 1.0)
    assert cut_up.per_s == pytest.approx(whole.per_s)


def test_the_prefill_rate_counts_only_steps_that_are_mostly_prefill():
    rate = PrefillRate(min_tokens=32, tokens_per_decode=16)
    rate.observe(16, 0, 0.001)     # too few tokens: fixed costs dominate
    rate.observe(64, 8, 1.0)       # 8 tokens per decode: the decodes' time is in it
    assert rate.tokens_per_s is None
    rate.observe(256, 4, 0.1)
    assert rate.tokens_per_s == pytest.approx(2560)


def cost(mode="auto", **kw) -> FetchCost:
    return FetchCost(KvFetchSettings(kv_fetch=mode, **kw), BLOCK, BYTES)


def test_before_any_fetch_is_measured_a_worthwhile_gain_is_fetched():
    plan = cost().plan(local_blocks=2, peer_blocks=10, prefill_tokens_per_s=200)
    assert plan == FetchPlan(blocks=10, gain=8, deadline_s=pytest.approx(2 * 8 * BLOCK / 200))


def test_fetch_when_the_measured_transfer_beats_the_prefill_it_saves():
    c = cost()
    c.observe_fetch(100 << 20, 0.1)  # ~1 GB/s: a block in ~0.35 ms, its prefill 8 ms at 2,000 tokens/s
    assert isinstance(c.plan(0, 10, 2000), FetchPlan)
    slow = cost()
    slow.observe_fetch(1 << 20, 1.0)  # 1 MB/s: a block in 0.35 s
    assert slow.plan(0, 10, 2000) == "cost"
    forced = cost("always")
    forced.observe_fetch(1 << 20, 1.0)
    assert isinstance(forced.plan(0, 10, 2000), FetchPlan)


def test_no_fetch_when_off_or_the_gain_is_small():
    assert cost("off").plan(0, 100, 2000) == "off"
    assert cost(kv_fetch_min_blocks=4).plan(5, 8, 2000) == "small"
    assert cost().plan(8, 8, 2000) == "small"
    assert cost().plan(9, 8, 2000) == "small"


def test_the_deadline_is_bounded_both_ways():
    c = cost(kv_fetch_min_deadline_s=0.5, kv_fetch_max_deadline_s=5.0)
    assert c.plan(0, 2, 1e6).deadline_s == 0.5          # a tiny prefill: at least the minimum
    assert c.plan(0, 1000, 10).deadline_s == 5.0        # a huge one: at most the maximum
    assert c.plan(0, 4, None).deadline_s == 5.0         # no prefill measured yet: the maximum


def test_bad_fetch_settings_are_one_line():
    with pytest.raises(SettingError, match="--kv-fetch must be one of"):
        KvFetchSettings(kv_fetch="sometimes")
    with pytest.raises(ValueError, match="--kv-fetch-min-deadline-s 9.0 is above --kv-fetch-max-deadline-s 1.0"):
        KvFetchSettings(kv_fetch_min_deadline_s=9, kv_fetch_max_deadline_s=1)
