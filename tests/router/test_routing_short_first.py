"""Routing a prompt that a node lets ahead of its long prefills (``--long-prefill-token-threshold``)."""

import random

import pytest

from kvfleet.router.routing import NodeLoad, NodePicker, RoutingConfig

OLD = -1e6  # READY long ago


def picker(**kw) -> NodePicker:
    return NodePicker(RoutingConfig(**kw), random.Random(0))


def holder(long_blocks: int = 60, threshold_blocks: int = 8) -> NodeLoad:
    """Holds a conversation's 70-block history and is prefilling a 60-block document (plus 4 blocks
    of a short prompt) at a threshold of 8 blocks (128 tokens of 16)."""
    return NodeLoad("holder", active_blocks=long_blocks + 4, cached_prefix_blocks=70, ready_since=OLD,
                    prefill_blocks=long_blocks + 4, long_prefill_blocks=long_blocks,
                    long_prefill_threshold_blocks=threshold_blocks)


def idle_peer() -> NodeLoad:
    """Holds none of it, idle, would fetch the history at 0.7 of a hot hit."""
    return NodeLoad("other", 0, 0, OLD, prefill_blocks=0, peer_prefix_blocks=70, peer_weight=0.7)


def test_a_short_turn_stays_with_its_history_while_the_node_prefills_a_document():
    p = picker()
    # 5 blocks to compute on the holder: short there, so the document weighs one step's chunk (8)
    assert p.load_for(holder(), missed_blocks=5) == pytest.approx(4 + 8)
    d = p.choose([holder(), idle_peer()], num_prompt_blocks=75, now=0)
    assert (d.node_id, d.reason) == ("holder", "kv") and d.cost == pytest.approx(5 + 12)
    # a node that lets no prompt first queues it behind the whole document: the peer fetches instead
    d = p.choose([holder(threshold_blocks=0), idle_peer()], 75, 0)
    assert d.node_id == "other" and d.cost == pytest.approx(5 + 0.3 * 70)


def test_a_long_prompt_waits_for_every_long_prefill_ahead():
    p = picker()
    assert p.load_for(holder(), missed_blocks=8) == p.load(holder()) == 64  # 8 blocks + a tail: long
    assert p.load_for(holder(), missed_blocks=40) == 64


def test_the_long_prefills_count_in_full_while_they_are_within_one_chunk():
    assert picker().load_for(holder(long_blocks=6), missed_blocks=2) == 10


def test_the_hot_spot_guard_weighs_the_load_the_prompt_would_wait_on():
    p = picker(hot_spot_ratio=2.0, hot_spot_margin_blocks=4)
    busy_peer = NodeLoad("other", 5, 0, OLD, prefill_blocks=5, peer_prefix_blocks=70, peer_weight=0.7)
    # the holder's 64 blocks would be past 2 * 5 + 4; the 12 the short turn waits on are not
    assert p.choose([holder(), busy_peer], 75, 0).node_id == "holder"


def test_routing_by_load_alone_is_blind_to_what_makes_a_prompt_short_there():
    # prefix_weight 0 knows no cache: the turn is 75 blocks to compute everywhere, so long
    p = picker(prefix_weight=0.0)
    d = p.choose([holder(), idle_peer()], 75, 0)
    assert d.node_id == "other" and d.cost == 0
    assert p.cost(holder(), 75) == 64
