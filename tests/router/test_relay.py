"""Relay's retry and resume rules, against fake nodes (no processes)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from kvfleet.core.membership import NodeInfo, NodeState
from kvfleet.core.sampling import SamplingParams
from kvfleet.core.tenants import Tenant
from kvfleet.router.node_stream import NodeFailure, NodeStream
from kvfleet.router.nodes import NodeTable, RouterNode
from kvfleet.router.prefix_lookup import BlockServicePrefixLookup
from kvfleet.router.relay import Relay, RelayError
from kvfleet.router.request import ParsedRequest
from kvfleet.router.routing import NodePicker, PrefixHit, RoutingConfig
from kvfleet.v1 import compute_pb2, inference_pb2

TENANT = Tenant("acme", "k", 10, 1, 4)


def failure(code, details="", refusal=""):
    return NodeFailure(code, details, refusal)


def error_event(request_id, code, details, refusal=""):
    return compute_pb2.RequestEvent(request_id=request_id, error=compute_pb2.RequestError(
        code=code.value[0], message=details, refusal=refusal))


class FakeStream:
    """Answers each start with the next scripted (tokens, end) of this node: ``end`` is a finish
    reason (the last token carries it), a NodeFailure (the stream broke) or an error event."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list = []
        self.finished: list = []

    def start(self, message):
        self.requests.append(message)
        tokens, end = self.script.pop(0)
        inbox = asyncio.Queue()
        events = [compute_pb2.RequestEvent(request_id=message.request_id,
                                           chunk=compute_pb2.ComputeChunk(token_ids=[t], text=str(t))) for t in tokens]
        if end is None:  # the node goes silent
            pass
        elif isinstance(end, int):
            events[-1].chunk.finish_reason = end
        elif isinstance(end, NodeFailure):
            events.append(end)
        else:  # an error event: (code, details, refusal)
            events.append(error_event(message.request_id, *end))
        for event in events:
            inbox.put_nowait(event)
        return inbox

    def finish(self, request_id, cancel):
        self.finished.append((request_id, cancel))


def table(scripts: dict) -> NodeTable:
    nodes = NodeTable(dial=lambda address, node_id: (None, None))  # nodes are placed by hand below
    for node_id, script in scripts.items():
        info = NodeInfo(node_id, f"{node_id}:1", "m", 64, 16, NodeState.READY)
        nodes.nodes[node_id] = RouterNode(info, None, FakeStream(script), ready_since=float("-inf"))
    return nodes


def relay(nodes, **options):
    return Relay(nodes, NodePicker(RoutingConfig(), random.Random(0)), BlockServicePrefixLookup(), max_attempts=3,
                 **options)


def run(nodes, max_tokens=5, **options):
    req = ParsedRequest("r", "r-1", [1, 2, 3], SamplingParams(max_tokens=max_tokens))

    async def collect():
        return [c async for c in relay(nodes, **options).run(req, TENANT)]

    return asyncio.run(collect())


def stub(nodes, node_id):
    return nodes.nodes[node_id].stream


LENGTH = inference_pb2.FINISH_REASON_LENGTH


def test_mid_stream_failure_resumes_elsewhere_without_repeats():
    died = failure(grpc.StatusCode.UNAVAILABLE, "socket closed")
    nodes = table({"a": [([10, 11], died)], "b": [([12, 13, 14], LENGTH)]})
    nodes.nodes["b"].active_blocks = 1  # "a" is chosen first
    chunks = run(nodes)
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14]
    assert [c.node_id for c in chunks] == ["a", "a", "b", "b", "b"]
    resumed = stub(nodes, "b").requests[0]
    assert list(resumed.prompt_token_ids) == [1, 2, 3, 10, 11] and resumed.num_resumed_tokens == 2
    assert resumed.sampling.max_tokens == 5 and resumed.request_id == "r-1.1"  # the node counts the resumed 2
    assert stub(nodes, "a").finished == [("r-1", False)] and stub(nodes, "b").finished == [("r-1.1", False)]
    last = chunks[-1]
    assert last.finish_reason == LENGTH and (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 5)


def test_failure_before_the_first_token_is_a_plain_retry():
    nodes = table({"a": [([], (grpc.StatusCode.UNKNOWN, "boom"))], "b": [([7, 8, 9, 10, 11], LENGTH)]})
    nodes.nodes["b"].active_blocks = 1
    assert [t for c in run(nodes) for t in c.token_ids] == [7, 8, 9, 10, 11]
    assert stub(nodes, "b").requests[0].num_resumed_tokens == 0


def test_answers_are_relayed_not_retried():
    quota = (grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant 'acme' KV quota exhausted", "quota")
    nodes = table({"a": [([], quota)], "b": []})
    nodes.nodes["b"].active_blocks = 1
    with pytest.raises(RelayError) as info:
        run(nodes)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in str(info.value)
    assert stub(nodes, "b").requests == []
    nodes = table({"a": [([], (grpc.StatusCode.INVALID_ARGUMENT, "prompt too long"))]})
    with pytest.raises(RelayError) as info:
        run(nodes)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_full_pool_tries_another_node():
    pool = (grpc.StatusCode.RESOURCE_EXHAUSTED, "block pool exhausted", "pool")
    nodes = table({"a": [([], pool)], "b": [([1, 2, 3, 4, 5], LENGTH)]})
    nodes.nodes["b"].active_blocks = 1
    assert chunks_nodes(run(nodes)) == {"b"}


def chunks_nodes(chunks):
    return {c.node_id for c in chunks}


def test_every_node_failing_is_unavailable():
    died = failure(grpc.StatusCode.UNAVAILABLE, "gone")
    nodes = table({"a": [([], died)], "b": [([], died)]})
    with pytest.raises(RelayError) as info:
        run(nodes)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no READY compute node" in str(info.value)
    with pytest.raises(RelayError, match="no READY compute node"):
        run(table({}))


def test_an_engine_error_on_every_node_reaches_the_client_as_internal_with_its_summary():
    raised = failure(grpc.StatusCode.INTERNAL, "engine step failed: AttributeError: no paged_prefill")
    nodes = table({"a": [([], raised)], "b": [([], raised)]})
    with pytest.raises(RelayError) as info:
        run(nodes)
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert "AttributeError: no paged_prefill" in str(info.value) and "['a', 'b']" in str(info.value)


def test_a_silent_node_counts_as_failed_and_is_cancelled():
    nodes = table({"a": [([10], None)], "b": [([11, 12, 13, 14], LENGTH)]})
    nodes.nodes["b"].active_blocks = 1
    chunks = run(nodes, stall_timeout_s=0.05)
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14]
    assert stub(nodes, "a").finished == [("r-1", True)]  # told to abort what it may still be running
    assert nodes.nodes["a"].failed_at is not None


def test_a_client_leaving_cancels_the_request_on_its_node():
    nodes = table({"a": [([10, 11, 12], None)]})
    req = ParsedRequest("r", "r-1", [1, 2, 3], SamplingParams(max_tokens=5))

    async def take_one():
        stream = relay(nodes).run(req, TENANT)
        first = await anext(stream)
        await stream.aclose()
        return first

    assert list(asyncio.run(take_one()).token_ids) == [10]
    assert stub(nodes, "a").finished == [("r-1", True)]
    assert nodes.nodes["a"].num_in_flight == 0 and nodes.nodes["a"].active_blocks == 0


def test_a_request_counts_as_prefill_ahead_until_its_first_token():
    nodes = table({"a": [([10, 11, 12], None)]})
    node = nodes.nodes["a"]
    req = ParsedRequest("r", "r-1", list(range(40)), SamplingParams(max_tokens=5))  # 3 blocks of 16
    seen = {}

    async def scenario():
        stream = relay(nodes).run(req, TENANT)
        real_start = node.stream.start

        def start(message):  # the router has sent it: counted, nothing back yet
            inbox = real_start(message)
            seen["sent"] = (node.active_blocks, node.prefill_blocks)
            return inbox

        node.stream.start = start
        await anext(stream)
        seen["first token"] = (node.active_blocks, node.prefill_blocks)
        await stream.aclose()

    asyncio.run(scenario())
    assert seen == {"sent": (3, 3), "first token": (3, 0)}
    assert (node.active_blocks, node.prefill_blocks) == (0, 0)


def test_an_end_of_turn_token_the_node_does_not_stop_at_ends_the_request():
    """The node stops at config.json's eos only; the router stops at the model's other end-of-turn
    tokens (generation_config.json, the tokenizer's eos) and cancels the rest on the node."""
    nodes = table({"a": [([10, 99, 11, 12], LENGTH)]})
    req = ParsedRequest("r", "r-1", [1, 2, 3], SamplingParams(max_tokens=5), stop_token_ids=frozenset({99}))

    async def collect():
        return [c async for c in relay(nodes).run(req, TENANT)]

    chunks = asyncio.run(collect())
    assert [t for c in chunks for t in c.token_ids] == [10, 99]
    assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_STOP
    assert chunks[-1].usage.completion_tokens == 2
    assert stub(nodes, "a").finished == [("r-1", True)]  # cancelled on the node


class SlowPrefill:
    """A node that prefills for ``heartbeats`` x ``every_s`` seconds, sending an empty chunk (its
    prefill progress) every ``every_s``, then its tokens."""

    def __init__(self, heartbeats: int, every_s: float, tokens: list[int]):
        self.heartbeats, self.every_s, self.tokens = heartbeats, every_s, tokens
        self.finished: list = []

    def start(self, message):
        inbox = asyncio.Queue()

        async def feed():
            for _ in range(self.heartbeats):
                await asyncio.sleep(self.every_s)
                inbox.put_nowait(compute_pb2.RequestEvent(request_id=message.request_id,
                                                          chunk=compute_pb2.ComputeChunk()))
            for i, t in enumerate(self.tokens):
                chunk = compute_pb2.ComputeChunk(token_ids=[t], text=str(t))
                if i == len(self.tokens) - 1:
                    chunk.finish_reason = LENGTH
                inbox.put_nowait(compute_pb2.RequestEvent(request_id=message.request_id, chunk=chunk))

        self.feeding = asyncio.get_running_loop().create_task(feed())
        return inbox

    def finish(self, request_id, cancel):
        self.finished.append((request_id, cancel))


def test_a_long_prefill_that_reports_progress_is_not_a_stall():
    """Prefill progress (empty chunks) for 20 stall timeouts' worth: heard, not forwarded."""
    nodes = table({})
    info = NodeInfo("a", "a:1", "m", 64, 16, NodeState.READY)
    nodes.nodes["a"] = RouterNode(info, None, SlowPrefill(40, 0.05, [1, 2, 3, 4, 5]), ready_since=float("-inf"))
    chunks = run(nodes, stall_timeout_s=0.5)
    assert [list(c.token_ids) for c in chunks] == [[1], [2], [3], [4], [5]]
    assert stub(nodes, "a").finished == [("r-1", False)]


class TieredLookup:
    """block_service's answer as the relay sees it: ``cold`` holds the prompt below its pool."""

    async def match(self, tenant, token_ids, nodes, prefix_group=""):
        return {"cold": PrefixHit(0, 3)}

    def routed(self, tenant, token_ids, node, prefix_group=""):
        pass


def test_a_node_holding_the_prompt_in_a_lower_tier_wins_over_a_miss():
    """``cold`` is a little busier, but holds the prompt's 3 blocks in host memory (worth
    half a hot hit each): 1 + 0.5 * 3 against 3 blocks to prefill on ``miss``."""
    nodes = table({"cold": [([5], LENGTH)], "miss": [([6], LENGTH)]})
    nodes.nodes["cold"].active_blocks = 1
    req = ParsedRequest("r", "r-1", list(range(50)), SamplingParams(max_tokens=1))
    tiered = Relay(nodes, NodePicker(RoutingConfig(), random.Random(0)), TieredLookup())

    async def collect():
        return [c async for c in tiered.run(req, TENANT)]

    assert chunks_nodes(asyncio.run(collect())) == {"cold"}


class DepartingLookup(TieredLookup):
    """``cold``'s key leaves etcd while its prefix lookup is awaited (an etcd outage past the
    leases): the membership moves it to ``departed``, its stream kept."""

    def __init__(self, nodes: NodeTable) -> None:
        self.nodes = nodes

    async def match(self, tenant, token_ids, nodes, prefix_group=""):
        self.nodes.departed["cold"] = self.nodes.nodes.pop("cold")
        return await super().match(tenant, token_ids, nodes, prefix_group)


def test_a_node_whose_key_leaves_etcd_during_the_prefix_lookup_still_gets_the_request():
    """Found by the chaos suite (etcd frozen past the leases): the relay took the chosen node from
    the membership by id after the lookup, and a stream ended UNKNOWN with KeyError: 'node-0'."""
    nodes = table({"cold": [([5], LENGTH)], "miss": [([6], LENGTH)]})
    nodes.nodes["cold"].active_blocks = 1
    req = ParsedRequest("r", "r-1", list(range(50)), SamplingParams(max_tokens=1))
    departing = Relay(nodes, NodePicker(RoutingConfig(), random.Random(0)), DepartingLookup(nodes))

    async def collect():
        return [c async for c in departing.run(req, TENANT)]

    assert chunks_nodes(asyncio.run(collect())) == {"cold"}  # its kept stream served it


class ClosedChannelStub:
    """A node's stub whose channel was closed when the node left etcd."""

    def Serve(self):
        raise grpc.aio.UsageError("Channel is closed")


def test_a_node_whose_channel_closed_after_it_was_picked_is_a_node_failure_and_is_retried():
    """Found by the partition bed's lossy soak: starting a Serve stream on a channel closed since
    (the node left etcd) raised UsageError through the relay, and the client got UNKNOWN."""
    inbox = NodeStream(ClosedChannelStub(), "gone").start(compute_pb2.ComputeRequest(request_id="r-1"))
    event = inbox.get_nowait()
    assert isinstance(event, NodeFailure) and event.code == grpc.StatusCode.UNAVAILABLE
    nodes = table({"ok": [([7], LENGTH)]})
    gone = NodeInfo("gone", "gone:1", "m", 64, 16, NodeState.READY)
    nodes.nodes["gone"] = RouterNode(gone, None, NodeStream(ClosedChannelStub(), "gone"), ready_since=float("-inf"))
    nodes.nodes["ok"].active_blocks = 50  # the picker prefers the departed node
    chunks = run(nodes, max_tokens=1)
    assert chunks[-1].finish_reason == LENGTH and chunks_nodes(chunks) == {"ok"}
