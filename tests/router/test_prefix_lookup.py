"""The router's prefix lookup with block_service down: routing goes on by load and recent routes,
one WARNING when lookups start failing (not one per request), and a node's pool that could not be
dropped meanwhile is dropped once block_service answers, unless the node came back."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvfleet.core.errors import NotFound
from kvfleet.core.kv_rates import KvRates
from kvfleet.core.membership import NodeInfo, NodeState
from kvfleet.router.nodes import RouterNode
from kvfleet.router.prefix_lookup import BlockServicePrefixLookup
from kvfleet.router.routing import PrefixHit


class Switchable:
    """block_service's client as the lookup uses it, with a switch for "unreachable" (a unit
    test of the lookup's own logic: what a real client raises then is a transport error)."""

    def __init__(self, hot=None, lower=None):
        self.down = False
        self.deregistered: list[str] = []
        self.hot = {"a": 1, "b": 1} if hot is None else hot  # the fleet's answer: every node it knows
        self.lower = {"b": 2} if lower is None else lower
        self.asked: list[list[str] | None] = []

    def _check(self):
        if self.down:
            raise ConnectionRefusedError("failed to connect to all addresses")

    async def match_tiers(self, hashes, node_ids=None):
        self._check()
        self.asked.append(node_ids)
        named = self.hot if node_ids is None else {n: self.hot.get(n, 0) for n in node_ids}
        return named, {n: k for n, k in self.lower.items() if n in named}

    async def deregister_node(self, node_id):
        self._check()
        if node_id == "unknown":
            raise NotFound("unknown node")
        self.deregistered.append(node_id)
        return []

    async def close(self):
        pass


def node(node_id: str) -> RouterNode:
    return RouterNode(NodeInfo(node_id, "x:1", "m", 64, 16, NodeState.READY), None, None)


def test_lookups_failing_route_by_recent_routes_and_say_so_once(caplog):
    client = Switchable()
    lookup = BlockServicePrefixLookup(client)
    nodes = [node("a"), node("b")]
    prompt = list(range(40))

    async def scenario():
        lookup.routed("t", prompt, nodes[1])
        client.down = True
        answers = [await lookup.match("t", prompt, nodes) for _ in range(5)]
        await lookup.forget_node("a")      # a's lease expired while block_service was down
        await lookup.forget_node("b")
        lookup.node_back("b")              # b registered again: its pool is its own to sync
        client.down = False
        back = await lookup.match("t", prompt, nodes)
        return answers, back

    with caplog.at_level(logging.INFO):
        answers, back = asyncio.run(scenario())
    assert all(a == {"b": PrefixHit(2)} for a in answers)  # this router's own recent route, nothing more
    assert caplog.text.count("prefix lookups in block_service fail") == 1
    assert "answers prefix lookups again" in caplog.text
    assert client.deregistered == ["a"]
    # b's recent routes went when it left; a can fetch the 2 blocks past its own 1 from b
    assert back == {"a": PrefixHit(1, 0, 2), "b": PrefixHit(1, 2)}


def test_a_recent_route_counts_as_hot_and_the_lower_tier_run_goes_on_past_it():
    """block_service says b holds 1 block hot and 2 more below its pool; this router just sent b a
    prompt of 2 blocks: 2 hot, then 1 more below (the lower-tier run ends where it did). a holds 1
    and can fetch 2 more from b."""
    lookup = BlockServicePrefixLookup(Switchable())
    nodes = [node("a"), node("b")]

    async def scenario():
        lookup.routed("t", list(range(40)), nodes[1])
        return await lookup.match("t", list(range(80)), nodes)

    assert asyncio.run(scenario()) == {"a": PrefixHit(1, 0, 2), "b": PrefixHit(2, 1)}


def test_peer_blocks_reach_to_the_longest_run_another_node_holds_candidate_or_not():
    """The fleet as block_service knows it: "busy" (not a candidate: it failed this request, or is
    draining) holds 6 blocks hot, b 2 hot and 3 below, c 7 hot; d is not in block_service's
    answer at all. Each candidate's peer blocks run from the end of its own run to the longest
    run of any OTHER node: c's own 7 are the fleet's longest, and the longest elsewhere (busy's 6)
    is shorter, so none for c."""
    client = Switchable(hot={"busy": 6, "a": 0, "b": 2, "c": 7}, lower={"b": 3})
    lookup = BlockServicePrefixLookup(client)
    found = asyncio.run(lookup.match("t", list(range(160)), [node("a"), node("b"), node("c"), node("d")]))
    assert found == {"a": PrefixHit(0, 0, 7), "b": PrefixHit(2, 3, 2), "c": PrefixHit(7, 0, 0),
                     "d": PrefixHit(0, 0, 7)}
    assert client.asked == [None]  # every node block_service knows, not only the candidates


def test_a_recent_route_is_not_a_run_to_fetch_from():
    """Blocks this router just sent to a are being computed there, not yet committed: a counts
    them as hot, b cannot fetch them."""
    lookup = BlockServicePrefixLookup(Switchable(hot={}, lower={}))
    a, b = node("a"), node("b")
    lookup.routed("t", list(range(64)), a)
    assert asyncio.run(lookup.match("t", list(range(64)), [a, b])) == {"a": PrefixHit(4)}


def test_a_node_s_load_carries_its_prefix_and_the_weights_its_rates_give():
    rates = KvRates(prefill_tokens_per_s=10_000.0, copy_in_bytes_per_s=4096e6, fetch_bytes_per_s=2048e6,
                    bytes_per_token=102_400.0)
    measured = RouterNode(NodeInfo("m", "x:1", "m", 64, 16, NodeState.READY, kv_rates=rates), None, None, 0.0)
    load = measured.load(PrefixHit(1, 2, 3))
    assert (load.cached_prefix_blocks, load.lower_tier_prefix_blocks, load.peer_prefix_blocks) == (1, 2, 3)
    assert (load.lower_tier_weight, load.peer_weight) == (pytest.approx(0.75), pytest.approx(0.5))
    plain = node("p").load()
    assert (plain.lower_tier_weight, plain.peer_weight, plain.peer_prefix_blocks) == (None, None, 0)


def test_a_node_that_never_fetches_counts_a_peer_held_block_as_a_miss():
    info = NodeInfo("off", "x:1", "m", 64, 16, NodeState.READY, fetches_kv=False)
    assert RouterNode(info, None, None, 0.0).load(PrefixHit(0, 0, 3)).peer_weight == 0.0
    assert NodeInfo.from_json("off", info.to_json()).fetches_kv is False
    assert NodeInfo.from_json("old", NodeInfo("old", "x:1", "m", 64, 16, NodeState.READY).to_json()).fetches_kv


def test_a_node_gone_from_etcd_keeps_its_pool_through_the_grace_and_back_in_time():
    """An etcd outage drops every node's key while the nodes serve on: a node listed again within
    the grace keeps its pool; one that stays away has it released once the grace is over."""
    client = Switchable()
    lookup = BlockServicePrefixLookup(client)

    async def scenario():
        lookup.node_left("a", grace_s=0.2)
        lookup.node_left("b", grace_s=0.2)
        lookup.node_left("b", grace_s=0.2)  # told twice: one release
        await asyncio.sleep(0.05)
        assert client.deregistered == []   # not yet: within the grace
        lookup.node_back("a")              # a's lease renewed once etcd answered
        await asyncio.sleep(0.4)
        await lookup.close()

    asyncio.run(scenario())
    assert client.deregistered == ["b"]
