"""Relay's retry and resume rules, against fake nodes (no processes)."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from compute_service.sampling import SamplingParams
from kvfleet.membership import NodeInfo, NodeState
from kvfleet.tenants import Tenant
from kvfleet.v1 import compute_pb2, inference_pb2
from router.nodes import NodeTable, RouterNode
from router.prefix_lookup import BlockServicePrefixLookup
from kvfleet.wire import REFUSAL_KEY
from router.relay import Relay, RelayError
from router.request import ParsedRequest
from router.routing import NodePicker, RoutingConfig

TENANT = Tenant("acme", "k", 10, 1, 4)


def rpc_error(code, details="", trailing=()):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


class FakeCall:
    def __init__(self, chunks, error):
        self.chunks, self.error = chunks, error

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for c in self.chunks:
            yield c
        if self.error is not None:
            raise self.error

    def cancel(self):
        pass


class FakeStub:
    """Answers each Generate with the next scripted (tokens, error-or-finish) of this node."""

    def __init__(self, script):
        self.script = list(script)
        self.requests: list = []

    def Generate(self, message):
        self.requests.append(message)
        tokens, end = self.script.pop(0)
        chunks = [compute_pb2.ComputeChunk(token_ids=[t], text=str(t)) for t in tokens]
        if isinstance(end, int):  # a finish reason: the last token carries it
            chunks[-1].finish_reason = end
            return FakeCall(chunks, None)
        return FakeCall(chunks, end)


def table(scripts: dict) -> NodeTable:
    nodes = NodeTable(dial=lambda address: (None, None))  # nodes are placed by hand below
    for node_id, script in scripts.items():
        info = NodeInfo(node_id, f"{node_id}:1", "m", 64, 16, NodeState.READY)
        nodes.nodes[node_id] = RouterNode(info, None, FakeStub(script), ready_since=float("-inf"))
    return nodes


def relay(nodes):
    return Relay(nodes, NodePicker(RoutingConfig(), random.Random(0)), BlockServicePrefixLookup(), max_attempts=3)


def run(nodes, max_tokens=5):
    req = ParsedRequest("r", "r-1", [1, 2, 3], SamplingParams(max_tokens=max_tokens))

    async def collect():
        return [c async for c in relay(nodes).run(req, TENANT)]

    return asyncio.run(collect())


def stub(nodes, node_id):
    return nodes.nodes[node_id].stub


LENGTH = inference_pb2.FINISH_REASON_LENGTH


def test_mid_stream_failure_resumes_elsewhere_without_repeats():
    died = rpc_error(grpc.StatusCode.UNAVAILABLE, "socket closed")
    nodes = table({"a": [([10, 11], died)], "b": [([12, 13, 14], LENGTH)]})
    nodes.nodes["b"].active_blocks = 1  # "a" is chosen first
    chunks = run(nodes)
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14]
    assert [c.node_id for c in chunks] == ["a", "a", "b", "b", "b"]
    resumed = stub(nodes, "b").requests[0]
    assert list(resumed.prompt_token_ids) == [1, 2, 3, 10, 11] and resumed.num_resumed_tokens == 2
    assert resumed.sampling.max_tokens == 3 and resumed.request_id == "r-1.1"
    last = chunks[-1]
    assert last.finish_reason == LENGTH and (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 5)


def test_failure_before_the_first_token_is_a_plain_retry():
    nodes = table({"a": [([], rpc_error(grpc.StatusCode.UNKNOWN, "boom"))], "b": [([7, 8, 9, 10, 11], LENGTH)]})
    nodes.nodes["b"].active_blocks = 1
    assert [t for c in run(nodes) for t in c.token_ids] == [7, 8, 9, 10, 11]
    assert stub(nodes, "b").requests[0].num_resumed_tokens == 0


def test_answers_are_relayed_not_retried():
    quota = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "tenant 'acme' KV quota exhausted", ((REFUSAL_KEY, "quota"),))
    nodes = table({"a": [([], quota)], "b": []})
    nodes.nodes["b"].active_blocks = 1
    with pytest.raises(RelayError) as info:
        run(nodes)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "quota" in str(info.value)
    assert stub(nodes, "b").requests == []
    nodes = table({"a": [([], rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long"))]})
    with pytest.raises(RelayError) as info:
        run(nodes)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_full_pool_tries_another_node():
    pool = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "block pool exhausted", ((REFUSAL_KEY, "pool"),))
    nodes = table({"a": [([], pool)], "b": [([1, 2, 3, 4, 5], LENGTH)]})
    nodes.nodes["b"].active_blocks = 1
    assert chunks_nodes(run(nodes)) == {"b"}


def chunks_nodes(chunks):
    return {c.node_id for c in chunks}


def test_every_node_failing_is_unavailable():
    died = rpc_error(grpc.StatusCode.UNAVAILABLE, "gone")
    nodes = table({"a": [([], died)], "b": [([], died)]})
    with pytest.raises(RelayError) as info:
        run(nodes)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and "no READY compute node" in str(info.value)
    with pytest.raises(RelayError, match="no READY compute node"):
        run(table({}))
