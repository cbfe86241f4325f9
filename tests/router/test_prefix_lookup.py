"""The router's prefix lookup with block_service down: routing goes on by load and recent routes,
one WARNING when lookups start failing (not one per request), and a node's pool that could not be
dropped meanwhile is dropped once block_service answers, unless the node came back."""

from __future__ import annotations

import asyncio
import logging

from kvfleet.errors import NotFound
from kvfleet.membership import NodeInfo, NodeState
from router.nodes import RouterNode
from router.prefix_lookup import BlockServicePrefixLookup
from router.routing import PrefixHit


class Switchable:
    """block_service's client as the lookup uses it, with a switch for "unreachable" (a unit
    test of the lookup's own logic: what a real client raises then is a transport error)."""

    def __init__(self):
        self.down = False
        self.deregistered: list[str] = []

    def _check(self):
        if self.down:
            raise ConnectionRefusedError("failed to connect to all addresses")

    async def match_tiers(self, hashes, node_ids):
        self._check()
        return {n: 1 for n in node_ids}, {"b": 2}

    async def deregister_node(self, node_id):
        self._check()
        if node_id == "unknown":
            raise NotFound("unknown node")
        self.deregistered.append(node_id)
        return []


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
    assert back == {"a": PrefixHit(1), "b": PrefixHit(1, 2)}  # b's recent routes went when it left


def test_a_recent_route_counts_as_hot_and_the_lower_tier_run_goes_on_past_it():
    """block_service says b holds 1 block hot and 2 more below its pool; this router just sent b a
    prompt of 2 blocks: 2 hot, then 1 more below (the lower-tier run ends where it did)."""
    lookup = BlockServicePrefixLookup(Switchable())
    nodes = [node("a"), node("b")]

    async def scenario():
        lookup.routed("t", list(range(40)), nodes[1])
        return await lookup.match("t", list(range(80)), nodes)

    assert asyncio.run(scenario()) == {"a": PrefixHit(1, 0), "b": PrefixHit(2, 1)}
