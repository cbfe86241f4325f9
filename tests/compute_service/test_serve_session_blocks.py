"""A Serve stream's requests and the blocks block_service holds for them: the node's early
allocation (``RemoteBlockAllocator.preallocate``) against a real BlockManager server
(served_blocks.py), the real engine (tiny model) taking the aborts."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.node.context import EarlyBlocks, NodeContext, NodeStatus
from kvfleet.compute_service.node.serve_session import ServeSession
from kvfleet.core.membership import NodeState
from kvfleet.v1 import compute_pb2
from tests.compute_service.served_blocks import BS, num_sequences


@pytest.fixture
def node_context(node, llama_dir):
    allocator, _, _ = node
    engine = AsyncEngine(LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=BS, kv_cache_memory=16 << 20)))

    async def preallocate(seq_id: str, tenant: str, token_ids: list[int], prefix_group: str = "") -> None:
        await allocator.preallocate(seq_id, tenant, token_ids, prefix_group=prefix_group)

    try:
        yield NodeContext(NodeStatus("n0", state=NodeState.READY), engine, block_size=BS,
                          early_blocks=EarlyBlocks(preallocate, allocator.release, {}))
    finally:
        engine.shutdown()


def test_a_request_cancelled_in_its_starts_command_batch_leaves_no_blocks(node, node_context):
    """The soak's leaks: the router batches the commands queued while it writes, so a
    request's start and its cancel (the client left at once) can arrive in one ``NodeCommands``.
    The start's task had not run when the cancel ended the request (releasing nothing: nothing was
    asked yet); it then asked for the prompt's blocks all the same, and nobody released them."""
    allocator, on_loop, client = node
    start = compute_pb2.ComputeRequest(request_id="r1", tenant="t", prompt_token_ids=list(range(40)))
    start.sampling.max_tokens = 4

    async def scenario():
        session = ServeSession(node_context)
        for command in (compute_pb2.NodeCommand(start=start), compute_pb2.NodeCommand(cancel="r1")):
            session.command(command)  # one message's commands, as the Compute servicer hands them
        started = [t for t in asyncio.all_tasks() if t.get_name() == "start-r1"]
        await asyncio.gather(*started)
        await allocator.settle()
        await allocator.flush()
        assert session.requests == {}

    on_loop(scenario())
    assert allocator.live_sequences() == []
    assert num_sequences(on_loop, client) == 0
