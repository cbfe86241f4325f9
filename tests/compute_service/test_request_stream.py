"""A request on a node's Serve stream, through ``RequestStream`` and the real engine (tiny model).

The router resumes a request whose node died on another node, from the prompt plus every token
it already delivered (``num_resumed_tokens`` of them). What the client reads must not show the
failure: the same tokens, the same text cut at the same stop string, the same finish.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.node.context import NodeContext, NodeStatus
from kvfleet.compute_service.node.request_stream import RequestStream
from kvfleet.core.membership import NodeState
from kvfleet.v1 import compute_pb2, inference_pb2
from tests.compute_service.conftest import late_stop_string, random_prompt

PROMPT = random_prompt(20, seed=11)
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def node(llama_dir):
    engine = AsyncEngine(LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=64 << 20)))
    try:
        yield NodeContext(NodeStatus("node-a", state=NodeState.READY), engine, block_size=16)
    finally:
        engine.shutdown()


def serve(node, request_id: str, ids: list[int], num_resumed: int, max_tokens: int, stop=()):
    """The chunks a request streams (one token each) until it finishes."""
    request = compute_pb2.ComputeRequest(request_id=request_id, tenant="t", prompt_token_ids=ids,
                                         num_resumed_tokens=num_resumed)
    request.sampling.max_tokens = max_tokens
    request.sampling.ignore_eos = True
    request.sampling.stop.extend(stop)

    async def main():
        events: list[compute_pb2.RequestEvent] = []
        done = asyncio.Event()
        stream = RequestStream(request, node, events.append, lambda _: done.set())
        await stream.run()
        await asyncio.wait_for(done.wait(), 60)
        return events

    events = asyncio.run(main())
    assert all(e.HasField("chunk") for e in events), events
    return [e.chunk for e in events]


def test_a_resumed_request_ends_at_its_stop_string_as_without_a_failure(node):
    free = "".join(c.text for c in serve(node, "free", PROMPT, 0, MAX_TOKENS))
    stop = late_stop_string(free, start=len(free) // 2)
    # the uninterrupted request: its stream is what every resumed one must reproduce
    whole = serve(node, "whole", PROMPT, 0, MAX_TOKENS, stop=[stop])
    tokens = [t for c in whole for t in c.token_ids]
    text = "".join(c.text for c in whole)
    assert whole[-1].finish_reason == inference_pb2.FINISH_REASON_STOP and text == free[:free.index(stop)]
    stop_token = len(tokens) - 1  # the one that completes the stop string
    assert tokens[stop_token - 1] == ord(stop[0]) and stop_token > 13  # byte tokens: token id == byte

    # the node dies after k tokens reached the client; another node resumes from the rest. The last
    # k straddles the stop string: its first character was generated before the failure.
    for k in (1, 10, stop_token - 3, stop_token):
        sent = whole[:k]
        resumed = serve(node, f"resumed-{k}", PROMPT + tokens[:k], k, MAX_TOKENS, stop=[stop])
        chunks = sent + resumed
        assert [t for c in chunks for t in c.token_ids] == tokens, k
        assert "".join(c.text for c in chunks) == text, k
        assert resumed[-1].finish_reason == inference_pb2.FINISH_REASON_STOP, k


def test_resumed_tokens_that_already_finish_the_request_are_refused(node):
    """The router never resumes a finished request; a node asked to is told a wrong request."""
    request = compute_pb2.ComputeRequest(request_id="over", tenant="t", prompt_token_ids=PROMPT + [65, 66],
                                         num_resumed_tokens=2)
    request.sampling.max_tokens = 2

    async def main():
        events: list[compute_pb2.RequestEvent] = []
        await RequestStream(request, node, events.append, lambda _: None).run()
        return events

    (event,) = asyncio.run(main())
    assert event.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "2 resumed tokens already finish the request (length)" in event.error.message


def test_a_chunked_prefill_streams_an_empty_chunk_per_chunk_before_its_first_token(llama_dir, node):
    """A long prompt prefills in chunks of ``max_num_batched_tokens`` for minutes before its first
    token: each chunk that samples nothing is an empty chunk, which the router's stall watch hears."""
    engine = AsyncEngine(LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=64 << 20,
                                                           max_num_batched_tokens=64)))
    try:
        chunked = NodeContext(NodeStatus("node-c", state=NodeState.READY), engine, block_size=16)
        chunks = serve(chunked, "long", random_prompt(200, seed=12), 0, 3)  # 4 chunks: 64 + 64 + 64 + 8
    finally:
        engine.shutdown()
    assert [len(c.token_ids) for c in chunks] == [0, 0, 0, 1, 1, 1]
    assert not chunks[0].HasField("usage") and chunks[3].HasField("usage")  # the first token's carries it
    unchunked = serve(node, "whole", random_prompt(200, seed=12), 0, 3)
    assert [t for c in chunks for t in c.token_ids] == [t for c in unchunked for t in c.token_ids]


def test_a_start_that_dies_ends_the_request_unavailable_and_holds_nothing(node, monkeypatch, caplog):
    """A fault of the node's own while a request starts (seen: a KV fetch asking on a channel closed
    under it) ends the request with UNAVAILABLE, which the router answers by sending it elsewhere;
    before, the start's task died, the request never ended, and its client hung."""
    async def broken_fetch(self, *args):
        raise RuntimeError("the fetch's channel is closed")

    monkeypatch.setattr(NodeContext, "fetch_prefix", broken_fetch)
    request = compute_pb2.ComputeRequest(request_id="dies", tenant="t", prompt_token_ids=PROMPT)
    request.sampling.max_tokens = 4
    ended = []

    async def main():
        events: list[compute_pb2.RequestEvent] = []
        await RequestStream(request, node, events.append, ended.append).run()
        await asyncio.sleep(0.2)  # an abort reaches the engine's thread
        return events, await node.engine_stats()

    (event,), stats = asyncio.run(main())
    assert event.error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert "could not start the request (RuntimeError: the fetch's channel is closed)" in event.error.message
    assert len(ended) == 1
    assert "starting request dies failed" in caplog.text
    assert stats.num_running == stats.num_waiting == 0
