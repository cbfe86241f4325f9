"""The remote allocator against a real BlockManager server: tables agree, the step is not stalled.

The node's two threads are reproduced: an event loop thread (block_service client, early
allocations, flushes) and the calling thread standing in for the engine's step loop.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from block_service.client import BlockManagerClient
from block_service.durable import DurablePageTable
from block_service.page_table import PageTable
from block_service.server import BlockManagerServicer
from block_service.tenants import TenantConfig
from compute_service.remote_allocator import DEFER_STEPS, RemoteAllocatorFactory
from kvfleet.allocator import Allocation, Refusal
from kvfleet.block_hash import block_hashes, tenant_extra_key
from kvfleet.v1 import block_manager_pb2_grpc

BS, BYTES_PER_BLOCK = 16, 1024


@pytest.fixture
def node():
    """(allocator, run-on-loop, page table) with block_service served in-process."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    table = PageTable()
    table.configure_tenants([TenantConfig("q", quota_mib=4 * BYTES_PER_BLOCK / 2**20)])

    async def start():
        server = grpc.aio.server()
        block_manager_pb2_grpc.add_BlockManagerServicer_to_server(BlockManagerServicer(DurablePageTable(table, None)), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = BlockManagerClient(f"127.0.0.1:{port}")
        return server, client

    server, client = on_loop(start())
    factory = RemoteAllocatorFactory(client, "n0", loop)
    allocator = factory(64, BS, BYTES_PER_BLOCK)  # called off the loop, as the engine does
    try:
        yield allocator, on_loop, table
    finally:
        on_loop(factory.close())
        on_loop(server.stop(None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def hashes(ids, tenant="t"):
    return block_hashes(ids, BS, tenant_extra_key(tenant), max_blocks=(len(ids) - 1) // BS)


def check_agrees(allocator, table):
    """block_service holds exactly the blocks the allocator knows (handed + reserve)."""
    for seq_id, blocks in allocator._tables.items():
        assert table._seqs[seq_id].block_ids == blocks
    assert set(table._seqs) == set(allocator._tables) | set(allocator._early)


def test_early_allocation_reserve_and_write_behind(node):
    allocator, on_loop, table = node
    ids = list(range(40))
    on_loop(allocator.preallocate("a", "t", ids))
    rpcs = allocator.num_rpcs
    got = allocator.allocate("a", "t", hashes(ids), 40)
    assert isinstance(got, Allocation) and len(got.block_ids) == 3
    assert allocator.num_rpcs == rpcs  # answered from the early allocation: no call on the step
    allocator.end_step()
    on_loop(allocator._flush())  # the top-up: one reserve block
    assert len(table._seqs["a"].block_ids) == 4
    rpcs = allocator.num_rpcs
    assert allocator.extend([("a", 48)]) == [[]]
    [new] = allocator.extend([("a", 49)])
    assert new == table._seqs["a"].block_ids[3:4] and allocator.num_rpcs == rpcs  # the reserve, no call
    allocator.commit([("a", i, h) for i, h in enumerate(block_hashes(ids + [0] * 8, BS, tenant_extra_key("t")))])
    allocator.end_step()
    on_loop(allocator._flush())
    check_agrees(allocator, table)
    allocator.release(["a"])
    allocator.end_step()
    on_loop(allocator._flush())
    assert table.allocator_stats("n0").num_used == 0 and table.allocator_stats("n0").num_cached == 3

    # The committed prefix is found by the next sequence (asked synchronously: no early allocation).
    got = allocator.allocate("b", "t", hashes(ids + [1, 2]), 42)
    assert got.num_cached_blocks == 2
    check_agrees(allocator, table)


def test_mismatch_and_forget_give_blocks_back(node):
    allocator, on_loop, table = node
    on_loop(allocator.preallocate("c", "t", list(range(30))))
    on_loop(allocator.preallocate("d", "t", list(range(20))))
    got = allocator.allocate("c", "t", hashes(list(range(50))), 50)  # asked differently: fresh table
    assert isinstance(got, Allocation) and len(got.block_ids) == 4
    allocator.forget("d")  # the request ended before the scheduler admitted it
    on_loop(allocator._flush())
    check_agrees(allocator, table)
    assert set(table._seqs) == {"c"}


def test_quota_refusal_after_the_reserve(node):
    allocator, on_loop, table = node  # tenant q may hold 4 blocks
    got = allocator.allocate("s", "q", [], 20)
    assert len(got.block_ids) == 2
    allocator.end_step()
    on_loop(allocator._flush())  # reserve: 3 blocks held
    assert allocator.extend([("s", 40)]) == [table._seqs["s"].block_ids[2:3]]
    allocator.end_step()
    on_loop(allocator._flush())  # reserve again: 4 blocks, the quota
    assert len(allocator.extend([("s", 64)])[0]) == 1
    allocator.end_step()
    on_loop(allocator._flush())  # the next reserve is refused (quota): nothing held beyond 4
    [refused] = allocator.extend([("s", 65)])
    assert isinstance(refused, Refusal) and refused.reason == "quota" and refused.tenant == "q"
    check_agrees(allocator, table)


def settle(allocator, on_loop):
    """Wait until a flush that ``end_step`` may have kicked off has finished."""

    async def after_flushes():
        await asyncio.sleep(0)  # a kick queued before this coroutine has created its flush task
        async with allocator._flush_lock:
            pass

    on_loop(after_flushes())


def decode_step(allocator, on_loop, seq_id: str, num_tokens: int, commits=()) -> tuple[list[int], int]:
    """One engine step growing ``seq_id`` to ``num_tokens``: (new blocks, calls made inside the step)."""
    allocator.begin_step()
    before = allocator.num_rpcs
    [new] = allocator.extend([(seq_id, num_tokens)])
    inside = allocator.num_rpcs - before
    allocator.commit(list(commits))
    allocator.end_step()
    settle(allocator, on_loop)
    return new, inside


def test_decode_bookkeeping_waits_for_company_yet_the_reserve_never_runs_dry(node):
    allocator, on_loop, table = node
    ids = list(range(20))  # one full prompt block, four tokens into the second
    allocator.allocate("a", "t", hashes(ids), 20)
    start = allocator.num_rpcs
    named = block_hashes(ids + list(range(100, 300)), BS, tenant_extra_key("t"))
    last = 20 + 6 * BS
    for n in range(21, last + DEFER_STEPS + 1):  # decode, a token a step, as the engine grows it
        if n == 21:
            commits = [("a", 0, named[0])]  # the prompt's full block
        elif (n - 2) % BS == 0 and n <= last:  # the step after a block filled, as the engine commits
            commits = [("a", (n - 2) // BS - 1, named[(n - 2) // BS - 1])]
        else:
            commits = []
        _, inside = decode_step(allocator, on_loop, "a", n, commits)
        assert inside == 0, f"token {n} waited for block_service: its reserve was not there"
    check_agrees(allocator, table)
    assert not allocator._commits and table._seqs["a"].num_committed == 7  # each within DEFER_STEPS steps
    # A block crossed costs a top-up in one step and a commit in the next: 13 calls if each step's
    # bookkeeping went on its own. Deferred, a crossing's two ride together with the next due top-up.
    assert allocator.num_rpcs - start <= 8


def test_releases_and_prompt_commits_are_sent_at_the_end_of_their_step(node):
    allocator, on_loop, table = node
    ids = list(range(40))  # two full prompt blocks
    allocator.allocate("p", "t", hashes(ids), 40)
    allocator.end_step()
    settle(allocator, on_loop)
    rpcs = allocator.num_rpcs
    prompt = block_hashes(ids, BS, tenant_extra_key("t"))
    decode_step(allocator, on_loop, "p", 41, [("p", 0, prompt[0]), ("p", 1, prompt[1])])
    assert allocator.num_rpcs == rpcs + 1 and not allocator._commits  # findable by the next request now
    assert allocator.allocate("q", "t", hashes(ids + [7]), 41).num_cached_blocks == 2
    rpcs = allocator.num_rpcs
    allocator.begin_step()
    allocator.release(["p"])
    allocator.end_step()
    settle(allocator, on_loop)
    assert allocator.num_rpcs == rpcs + 1 and "p" not in table._seqs
