import dataclasses
import random
from collections import Counter

import pytest

from kvfleet.core.kv_rates import KvRates, lower_tier_weight, peer_weight
from kvfleet.router.routing import NodeLoad, NodePicker, RoutingConfig

OLD = -1e6  # READY long ago: fully warmed


def node(nid, active=0, cached=0, since=OLD):
    return NodeLoad(nid, active, cached, since)


def picker(**kw):
    return NodePicker(RoutingConfig(**kw), random.Random(0))


def test_prefix_cached_node_wins_against_a_little_more_load():
    p = picker()
    d = p.choose([node("a", active=3, cached=8), node("b", active=0)], num_prompt_blocks=10, now=0)
    assert (d.node_id, d.reason, d.cached_prefix_blocks) == ("a", "kv", 8)
    assert d.cost == 1 * 2 + 3


def test_load_wins_when_the_prefix_saving_is_small():
    d = picker().choose([node("a", active=20, cached=2), node("b", active=5)], 10, 0)
    assert d.node_id == "b"


def test_prefix_weight_scales_the_cache_term():
    nodes = [node("a", active=12, cached=10), node("b", active=0)]
    assert picker(prefix_weight=1.0).choose(nodes, 10, 0).node_id == "b"
    assert picker(prefix_weight=2.0).choose(nodes, 10, 0).node_id == "a"


def test_ties_are_broken_at_random():
    p = picker()
    picks = Counter(p.choose([node("a"), node("b"), node("c")], 4, 0).node_id for _ in range(300))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 50


def test_hot_spot_guard_falls_back_to_least_loaded():
    p = picker(prefix_weight=10.0, hot_spot_ratio=2.0, hot_spot_margin_blocks=4)
    nodes = [node("hot", active=30, cached=10), node("cool", active=5), node("warm", active=12)]
    d = p.choose(nodes, 10, 0)
    assert (d.node_id, d.reason) == ("cool", "hot_spot")
    # Not far busier: 14 <= 2 · 5 + 4, so the prefix keeps the request.
    nodes[0] = node("hot", active=14, cached=10)
    assert p.choose(nodes, 10, 0).node_id == "hot"


def test_no_node_no_decision():
    p = picker()
    assert p.choose([], 1, 0) is None


def test_cold_start_share_ramps_over_the_window():
    p = picker(warmup_s=10.0, warmup_min_share=0.1)
    fresh = node("new", since=0.0)
    assert p.share(fresh, 0.0) == pytest.approx(0.1)
    assert p.share(fresh, 5.0) == pytest.approx(0.55)
    assert p.share(fresh, 10.0) == p.share(fresh, 99.0) == 1.0

    def fraction_to_new(now, n=2000):
        # The new node is idle, the old one busy: on cost alone the new node would take everything.
        nodes = [node("old", active=8), fresh]
        return sum(p.choose(nodes, 2, now).node_id == "new" for _ in range(n)) / n

    shares = [fraction_to_new(t) for t in (0.0, 5.0, 10.0)]
    assert shares[0] == pytest.approx(0.1, abs=0.03)
    assert shares[1] == pytest.approx(0.55, abs=0.05)
    assert shares[2] == 1.0


def test_only_warming_nodes_still_serve():
    p = picker(warmup_s=10.0, warmup_min_share=0.01)
    assert p.choose([node("a", since=0.0)], 1, 0.0).node_id == "a"


def test_bad_config():
    for kw in [dict(prefix_weight=-1), dict(hot_spot_ratio=0.5), dict(warmup_s=-1),
               dict(warmup_min_share=0), dict(hot_spot_margin_blocks=-1)]:
        with pytest.raises(ValueError):
            RoutingConfig(**kw)


def test_decisions_are_counted_by_node_and_reason():
    """The router's metrics read these counts: every decision once, with the reason it was made."""
    p = picker(prefix_weight=10.0, hot_spot_ratio=2.0, hot_spot_margin_blocks=4)
    p.choose([node("a", active=3, cached=8), node("b", active=0)], 10, 0)
    p.choose([node("hot", active=30, cached=10), node("cool", active=5)], 10, 0)
    assert p.decisions == {("a", "kv"): 1, ("cool", "hot_spot"): 1}


def test_a_decision_narrowed_by_the_warm_up_ramp_says_so():
    # "new" just turned READY: it is a candidate with probability 0.1, so most decisions leave it out
    p = picker(warmup_s=30.0, warmup_min_share=0.1)
    nodes = [node("old", active=5), node("new", active=0, since=0.0)]
    reasons = Counter(p.choose(nodes, 4, now=0.0).reason for _ in range(200))
    assert reasons["warmup"] > 100 and set(reasons) <= {"warmup", "kv"}
    assert sum(p.decisions.values()) == 200


def test_hot_beats_lower_tier_beats_miss_at_equal_load():
    """A block the node keeps in host memory or on disk saves the prefill but costs a copy
    back; the picker ranks the three nodes hot, then lower tier, then nothing."""
    hot, cold, miss = node("hot", cached=8), NodeLoad("cold", 0, 0, OLD, 8), node("miss")
    p = picker()
    assert p.cost(hot, 10) < p.cost(cold, 10) < p.cost(miss, 10)
    assert p.cost(cold, 10) == 2 + 0.5 * 8                      # the default weight: half a hot hit
    assert p.choose([miss, cold], 10, 0).node_id == "cold"
    assert p.choose([cold, hot, miss], 10, 0).node_id == "hot"
    partly = NodeLoad("partly", 0, 4, OLD, 4)                    # 4 hot, 4 more below the pool
    assert p.cost(hot, 10) < p.cost(partly, 10) < p.cost(cold, 10)


def test_the_lower_tier_weight_and_its_bounds():
    cold = NodeLoad("cold", 3, 0, OLD, 8)
    assert picker(lower_tier_hit_weight=1.0).cost(cold, 10) == picker().cost(node("x", 3, 8), 10)
    assert picker(lower_tier_hit_weight=0.0).cost(cold, 10) == picker().cost(node("x", 3), 10)
    assert picker().cost(NodeLoad("c", 0, 6, OLD, 100), 10) == 0.5 * 4  # never more blocks than the prompt's
    with pytest.raises(ValueError, match="--lower-tier-hit-weight"):
        RoutingConfig(lower_tier_hit_weight=1.5)


def test_the_router_flag_takes_a_share_and_says_so_in_one_line_otherwise():
    import argparse

    from kvfleet.core.settings import SettingError, build
    from kvfleet.router.main import add_arguments
    from kvfleet.router.settings import RouterSettings

    parser = argparse.ArgumentParser(prog="kvfleet router")
    add_arguments(parser)
    base = ["--etcd", "http://x:1", "--tenants", "t.yaml"]

    def routing(*argv: str) -> RoutingConfig:
        return build(RouterSettings, parser.parse_args([*base, *argv])).routing

    assert routing().lower_tier_hit_weight == 0.5
    assert routing("--lower-tier-hit-weight", "0.8").lower_tier_hit_weight == 0.8
    with pytest.raises(SettingError) as refused:
        routing("--lower-tier-hit-weight", "2")
    assert str(refused.value) == "--lower-tier-hit-weight must be at most 1, got 2"


def test_decoding_blocks_weigh_a_tenth_of_the_prefill_queued_ahead():
    # "a" holds the conversation's 12-block history and decodes 200 blocks of other requests;
    # "b" holds nothing and has 20 blocks still to prefill: the first token comes sooner on "a"
    a = NodeLoad("a", active_blocks=200, cached_prefix_blocks=12, ready_since=OLD, prefill_blocks=0)
    b = NodeLoad("b", active_blocks=20, cached_prefix_blocks=0, ready_since=OLD, prefill_blocks=20)
    p = picker()
    assert p.load(a) == pytest.approx(20.0) and p.load(b) == 20
    d = p.choose([a, b], num_prompt_blocks=14, now=0)
    assert (d.node_id, d.reason) == ("a", "kv") and d.cost == pytest.approx(2 + 20.0)
    # counted in full (Dynamo's cost, decode_block_weight 1), the decodes push it away from its cache
    assert picker(decode_block_weight=1.0).choose([a, b], 14, 0).node_id == "b"


def test_without_a_prefill_split_every_active_block_counts_in_full():
    assert picker().load(node("x", active=30)) == 30


def test_the_hot_spot_guard_compares_loads():
    p = picker(prefix_weight=10.0, hot_spot_ratio=2.0, hot_spot_margin_blocks=4)

    def decoding(blocks):
        return NodeLoad("hot", active_blocks=blocks, cached_prefix_blocks=10, ready_since=OLD, prefill_blocks=0)

    assert p.choose([decoding(100), node("cool", active=5)], 10, 0).node_id == "hot"  # load 10 <= 2 * 5 + 4
    d = p.choose([decoding(300), node("cool", active=5)], 10, 0)                       # load 30 > 14
    assert (d.node_id, d.reason) == ("cool", "hot_spot")


def test_the_decode_weight_is_a_share():
    with pytest.raises(ValueError, match="--decode-block-weight"):
        RoutingConfig(decode_block_weight=1.5)


def test_hot_beats_lower_tier_beats_a_peer_fetch_beats_miss():
    """Past its own run a node can fetch the blocks another node holds: cheaper than computing
    them, dearer than copying its own back (the defaults: l = 0.5, p = 0.25), and so for the
    weights a node derives from typical rates (a copy from host memory faster than a fetch)."""
    hot, lower, peer, miss = node("hot", cached=8), NodeLoad("lower", 0, 0, OLD, 8), \
        NodeLoad("peer", 0, 0, OLD, peer_prefix_blocks=8), node("miss")
    p = picker()
    assert p.cost(hot, 10) < p.cost(lower, 10) < p.cost(peer, 10) < p.cost(miss, 10)
    assert p.cost(peer, 10) == 2 + 0.75 * 8
    assert p.choose([miss, peer], 10, 0).node_id == "peer"
    rates = KvRates(prefill_tokens_per_s=10_000.0, copy_in_bytes_per_s=8192e6, fetch_bytes_per_s=2048e6,
                    bytes_per_token=102_400.0)
    lw, pw = lower_tier_weight(rates), peer_weight(rates)
    assert (lw, pw) == (pytest.approx(0.875), pytest.approx(0.5))

    def measured(load: NodeLoad) -> NodeLoad:
        return dataclasses.replace(load, lower_tier_weight=lw, peer_weight=pw)

    assert p.cost(measured(hot), 10) < p.cost(measured(lower), 10) < p.cost(measured(peer), 10) \
        < p.cost(measured(miss), 10)
    assert p.cost(measured(lower), 10) == pytest.approx(2 + 0.125 * 8)


def test_an_idle_node_that_can_fetch_takes_a_prefix_from_a_busy_holder():
    """The holder has 10 of the prompt's 12 blocks hot and 8 blocks of prefill queued; the idle
    node holds none but can fetch them. Counted as a miss (p = 0), the holder wins; at a fetch
    worth 0.9 of a hot hit the idle node takes the request without computing the prefix."""
    holder = NodeLoad("holder", active_blocks=8, cached_prefix_blocks=10, ready_since=OLD)
    idle = NodeLoad("idle", active_blocks=0, cached_prefix_blocks=0, ready_since=OLD, peer_prefix_blocks=10)
    assert picker(peer_hit_weight=0.0).choose([holder, idle], 12, 0).node_id == "holder"
    d = picker(peer_hit_weight=0.0).choose([holder, dataclasses.replace(idle, peer_weight=0.9)], 12, 0)
    assert (d.node_id, d.reason) == ("idle", "kv") and d.cost == pytest.approx(2 + 0.1 * 10)
    assert picker(peer_hit_weight=0.9).choose([holder, idle], 12, 0).node_id == "idle"  # the fallback alike


def test_a_node_s_own_weights_override_the_configured_ones_and_none_falls_back():
    p = picker(lower_tier_hit_weight=0.5, peer_hit_weight=0.25)
    plain = NodeLoad("n", 0, 2, OLD, 3, None, 4)
    assert p.tier_weights(plain) == (0.5, 0.25)
    assert p.cost(plain, 10) == 0.5 * 3 + 0.75 * 4 + 1
    own = dataclasses.replace(plain, lower_tier_weight=1.0, peer_weight=0.0)
    assert p.tier_weights(own) == (1.0, 0.0)
    assert p.cost(own, 10) == 4 + 1
    assert p.cost(NodeLoad("c", 0, 6, OLD, 3, None, 100), 10) == 0.5 * 3 + 0.75 * 1  # never past the prompt


def test_the_peer_weight_flag():
    import argparse

    from kvfleet.core.settings import SettingError, build
    from kvfleet.router.main import add_arguments
    from kvfleet.router.settings import RouterSettings

    parser = argparse.ArgumentParser(prog="kvfleet router")
    add_arguments(parser)
    base = ["--etcd", "http://x:1", "--tenants", "t.yaml"]
    assert build(RouterSettings, parser.parse_args(base)).routing.peer_hit_weight == 0.25
    assert build(RouterSettings, parser.parse_args([*base, "--peer-hit-weight", "0.4"])).routing.peer_hit_weight == 0.4
    with pytest.raises(SettingError, match="--peer-hit-weight must be at most 1, got 1.5"):
        build(RouterSettings, parser.parse_args([*base, "--peer-hit-weight", "1.5"]))
