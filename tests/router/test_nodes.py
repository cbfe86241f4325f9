"""The router's node table: a node whose lease lapses keeps its stream while requests run on it."""

from __future__ import annotations

import asyncio
import json

from kvfleet.core.membership import MembershipChange, NodeInfo, NodeState
from kvfleet.router.nodes import NodeTable
from kvfleet.v1 import compute_pb2


class Line:
    """A channel or a stream as the table sees them: something to close, and requests to start."""

    def __init__(self, dialled: list[str], address: str):
        self.closed = False
        dialled.append(address)

    async def close(self) -> None:
        self.closed = True

    def start(self, request):
        return None

    def finish(self, request_id: str, cancel: bool) -> None:
        pass


def make_table() -> tuple[NodeTable, list[str]]:
    dialled: list[str] = []
    return NodeTable(dial=lambda address, node_id: (Line([], address), Line(dialled, address))), dialled


def info(node_id: str = "n0", address: str = "127.0.0.1:1") -> NodeInfo:
    return NodeInfo(node_id, address, "m", 64, 16, NodeState.READY)


def start_one(table: NodeTable, node_id: str = "n0"):
    node = table.get(node_id)
    node.start("s1", compute_pb2.ComputeRequest(request_id="s1-a", prompt_token_ids=[1, 2, 3]))
    return node


async def departed_with_a_request() -> tuple[NodeTable, list[str], object]:
    """A table whose node n0 runs a request and has just left etcd (its lease lapsed)."""
    table, dialled = make_table()
    await table.apply(MembershipChange("n0", info()))
    node = start_one(table)
    await table.apply(MembershipChange("n0", None))
    return table, dialled, node


def test_a_lapsed_lease_keeps_the_stream_of_requests_in_flight_until_the_last_ends():
    async def scenario():
        table, _, node = await departed_with_a_request()
        assert table.ready() == [] and not node.stream.closed  # not routed to, not hung up
        table.finish(node, "s1", "s1-a", cancel=False)
        await table.close()
        assert node.stream.closed and table.departed == {}

    asyncio.run(scenario())


def test_a_departed_node_back_at_its_address_keeps_its_stream():
    async def scenario():
        table, dialled, node = await departed_with_a_request()
        await table.apply(MembershipChange("n0", info()))
        assert dialled == ["127.0.0.1:1"] and table.get("n0") is node and table.ready() == [node]
        table.finish(node, "s1", "s1-a", cancel=False)
        assert not node.stream.closed  # it is a member again: its stream serves new requests

    asyncio.run(scenario())


def test_an_idle_node_that_leaves_is_hung_up_at_once_and_a_moved_one_always():
    async def scenario():
        table, dialled = make_table()
        await table.apply(MembershipChange("n0", info()))
        idle = table.get("n0")
        await table.apply(MembershipChange("n0", None))
        assert idle.stream.closed
        await table.apply(MembershipChange("n0", info()))
        busy = start_one(table)
        await table.apply(MembershipChange("n0", info(address="127.0.0.1:2")))
        assert busy.stream.closed and dialled == ["127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:2"]

    asyncio.run(scenario())


def test_capacity_is_the_sum_of_the_ready_nodes_live_caps():
    async def scenario():
        table, _ = make_table()
        assert table.capacity() is None  # no node READY: no limit (requests get UNAVAILABLE, not a wait)
        capped = lambda node_id, cap, state=NodeState.READY: NodeInfo(  # noqa: E731
            node_id, f"127.0.0.1:{cap}{len(node_id)}", "m", 64, 16, state, max_num_seqs=cap)
        await table.apply(MembershipChange("a", capped("a", 8)))
        await table.apply(MembershipChange("b", capped("b", 4)))
        await table.apply(MembershipChange("w", capped("w", 16, NodeState.WARMING)))
        assert table.capacity() == 12
        await table.apply(MembershipChange("a", capped("a", 3)))  # a's controller lowered its cap
        assert table.capacity() == 7
        await table.apply(MembershipChange("b", None))
        assert table.capacity() == 3
        await table.apply(MembershipChange("old", info("old", "127.0.0.1:9")))  # publishes no cap
        assert table.capacity() is None
        await table.close()

    asyncio.run(scenario())


def test_a_request_counts_only_the_blocks_it_adds_past_the_prefix_it_found_cached():
    async def scenario():
        table, _ = make_table()
        await table.apply(MembershipChange("n0", info()))
        node = table.get("n0")
        prompt = list(range(5 * 16 + 3))  # five full blocks and part of a sixth
        node.start("s1", compute_pb2.ComputeRequest(request_id="s1-a", prompt_token_ids=prompt), cached_blocks=5)
        node.start("s2", compute_pb2.ComputeRequest(request_id="s2-a", prompt_token_ids=prompt), cached_blocks=0)
        assert node.active_blocks == 1 + 6   # s1 found the prefix held there; s2 computes all of it
        assert node.prefill_blocks == 1 + 6  # neither has had a token yet
        node.hold_seq("s1", len(prompt) + 20, decoding=True)  # s1 generated into a seventh block
        assert node.active_blocks == 2 + 6 and node.prefill_blocks == 6
        table.finish(node, "s2", "s2-a", cancel=False)
        table.finish(node, "s1", "s1-a", cancel=False)
        assert node.active_blocks == 0 and node.prefill_blocks == 0
        await table.close()

    asyncio.run(scenario())


def test_the_blocks_of_prompts_past_the_nodes_threshold_count_as_long_until_their_first_token():
    async def scenario():
        table, _ = make_table()
        await table.apply(MembershipChange("n0", NodeInfo("n0", "127.0.0.1:1", "m", 64, 16, NodeState.READY,
                                                          long_prefill_token_threshold=64)))
        node = table.get("n0")
        document, question = list(range(10 * 16)), list(range(5 * 16 + 3))
        node.start("doc", compute_pb2.ComputeRequest(request_id="doc-a", prompt_token_ids=document))
        node.start("q", compute_pb2.ComputeRequest(request_id="q-a", prompt_token_ids=question), cached_blocks=4)
        # the question computes 19 tokens past its 4 cached blocks: short; the document 160: long
        assert (node.prefill_blocks, node.long_prefill_blocks) == (10 + 2, 10)
        load = node.load()
        assert (load.long_prefill_blocks, load.long_prefill_threshold_blocks) == (10, 4)
        node.hold_seq("doc", len(document) + 1, decoding=True)  # its first token: no longer work ahead
        assert (node.prefill_blocks, node.long_prefill_blocks) == (2, 0)
        table.finish(node, "q", "q-a", cancel=False)
        table.finish(node, "doc", "doc-a", cancel=False)
        assert (node.active_blocks, node.prefill_blocks, node.long_prefill_blocks) == (0, 0, 0)
        await table.close()

    asyncio.run(scenario())


def test_a_node_that_lets_no_prompt_first_has_no_long_prefills():
    async def scenario():
        table, _ = make_table()
        await table.apply(MembershipChange("n0", info()))
        node = table.get("n0")
        node.start("doc", compute_pb2.ComputeRequest(request_id="doc-a", prompt_token_ids=list(range(500))))
        assert node.long_prefill_blocks == 0 and node.load().long_prefill_threshold_blocks == 0
        await table.close()

    asyncio.run(scenario())


def test_the_threshold_travels_in_the_membership_record_and_an_older_record_has_none():
    published = NodeInfo("n0", "127.0.0.1:1", "m", 64, 16, NodeState.READY, long_prefill_token_threshold=128)
    assert NodeInfo.from_json("n0", published.to_json()) == published
    older = json.loads(published.to_json())
    del older["long_prefill_token_threshold"]  # written before the field existed
    assert NodeInfo.from_json("n0", json.dumps(older).encode()).long_prefill_token_threshold == 0
