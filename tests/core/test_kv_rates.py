"""A node's measured KV rates: their record in membership, and the weights the router derives."""

from __future__ import annotations

import json
import logging

import pytest

from kvfleet.core.kv_rates import KvRates, lower_tier_weight, peer_weight
from kvfleet.core.membership import NodeInfo, NodeState

# a node prefilling 10,000 tokens/s of a model with 100 KiB of KV per token (a token's prefill: 100 µs)
RATES = KvRates(prefill_tokens_per_s=10_000.0, copy_in_bytes_per_s=4096e6, fetch_bytes_per_s=1024e6,
                bytes_per_token=102_400.0)


def test_a_weight_is_one_minus_the_transfer_time_against_the_prefill_time():
    # copying a token in: 102,400 B / 4,096 MB/s = 25 µs of 100 µs; fetching it: 100 µs of 100 µs
    assert lower_tier_weight(RATES) == pytest.approx(0.75)
    assert peer_weight(RATES) == pytest.approx(0.0)
    faster = KvRates(10_000.0, 4096e6, 2048e6, 102_400.0)
    assert peer_weight(faster) == pytest.approx(0.5)


def test_weights_are_clamped_to_a_share():
    slow = KvRates(10_000.0, 1e6, 1e6, 102_400.0)          # a transfer 100x slower than the prefill
    free = KvRates(1.0, 1e18, 1e18, 1.0)                   # a transfer that costs nothing
    assert lower_tier_weight(slow) == peer_weight(slow) == 0.0
    assert 0.999 < lower_tier_weight(free) <= 1.0 and 0.999 < peer_weight(free) <= 1.0


def test_an_unknown_rate_gives_no_weight():
    assert lower_tier_weight(None) is None and peer_weight(None) is None
    no_tier = KvRates(10_000.0, 0.0, 1024e6, 102_400.0)
    assert lower_tier_weight(no_tier) is None and peer_weight(no_tier) == pytest.approx(0.0)
    for unmeasured in (KvRates(0.0, 4096e6, 1024e6, 102_400.0), KvRates(10_000.0, 4096e6, 1024e6, 0.0)):
        assert lower_tier_weight(unmeasured) is None and peer_weight(unmeasured) is None


def test_the_record_round_trips_ignores_keys_it_does_not_know_and_misses_nothing_silently():
    assert KvRates.from_dict(RATES.to_dict()) == RATES
    assert KvRates.from_dict({**RATES.to_dict(), "decode_tokens_per_s": 50.0}) == RATES  # a newer node's
    assert KvRates.from_dict({"prefill_tokens_per_s": 10}) == KvRates(10.0, 0.0, 0.0, 0.0)  # the rest unknown
    for bad, says in [([1, 2], "must be an object"), ({"fetch_bytes_per_s": "fast"}, "fetch_bytes_per_s"),
                      ({"bytes_per_token": -1}, "bytes_per_token"), ({"copy_in_bytes_per_s": float("nan")}, "copy_in"),
                      ({"prefill_tokens_per_s": True}, "prefill_tokens_per_s")]:
        with pytest.raises(ValueError, match=says):
            KvRates.from_dict(bad)


def info(**kw) -> NodeInfo:
    return NodeInfo("n1", "127.0.0.1:7001", "/models/tiny", 64, 16, NodeState.READY, 8, **kw)


def test_membership_carries_the_rates_and_reads_records_without_them():
    with_rates = info(kv_rates=RATES)
    assert NodeInfo.from_json("n1", with_rates.to_json()) == with_rates
    assert json.loads(with_rates.to_json())["kv_rates"] == RATES.to_dict()
    without = info()
    assert "kv_rates" not in json.loads(without.to_json())  # as a record before the field existed
    assert NodeInfo.from_json("n1", without.to_json()) == without and without.kv_rates is None


def test_a_malformed_rate_leaves_the_node_listed_without_rates(caplog):
    record = json.loads(info(kv_rates=RATES).to_json())
    record["kv_rates"]["fetch_bytes_per_s"] = "fast"
    with caplog.at_level(logging.WARNING):
        read = NodeInfo.from_json("n1", json.dumps(record).encode())
    assert read == info()
    assert "node n1 publishes malformed kv_rates" in caplog.text
