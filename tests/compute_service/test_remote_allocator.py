"""The remote allocator against a real BlockManager server: tables agree, the step is not stalled.

The server and the node's two threads are set up in served_blocks.py.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from kvfleet.compute_service.blocks.allocator_policy import DEFER_STEPS
from kvfleet.core.allocator import Allocation, Refusal
from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from tests.compute_service.served_blocks import (
    BS,
    check_agrees,
    hashes,
    held,
    release_on_loop,
)


def test_early_allocation_reserve_and_write_behind(node):
    allocator, on_loop, client = node
    ids = list(range(40))
    on_loop(allocator.preallocate("a", "t", ids))
    rpcs = allocator.num_rpcs
    got = allocator.allocate("a", "t", hashes(ids), 40)
    assert isinstance(got, Allocation) and len(got.block_ids) == 3
    assert allocator.num_rpcs == rpcs  # answered from the early allocation: no call on the step
    allocator.end_step()
    on_loop(allocator.flush())  # the top-up: one reserve block
    assert len(held(on_loop, client, "a").block_ids) == 4
    rpcs = allocator.num_rpcs
    assert allocator.extend([("a", 48)]) == [[]]
    [new] = allocator.extend([("a", 49)])
    assert new == held(on_loop, client, "a").block_ids[3:4] and allocator.num_rpcs == rpcs  # the reserve, no call
    allocator.commit([("a", i, h) for i, h in enumerate(block_hashes(ids + [0] * 8, BS, tenant_extra_key("t")))])
    allocator.end_step()
    on_loop(allocator.flush())
    check_agrees(allocator, on_loop, client)
    allocator.release(["a"])
    allocator.end_step()
    on_loop(allocator.flush())
    nodes, _ = on_loop(client.stats(["n0"]))
    assert (nodes[0].num_used, nodes[0].num_cached, nodes[0].num_sequences) == (0, 3, 0)

    # The committed prefix is found by the next sequence (asked synchronously: no early allocation).
    got = allocator.allocate("b", "t", hashes(ids + [1, 2]), 42)
    assert got.num_cached_blocks == 2
    check_agrees(allocator, on_loop, client)


def test_mismatch_and_release_of_an_unclaimed_sequence_give_blocks_back(node):
    allocator, on_loop, client = node
    on_loop(allocator.preallocate("c", "t", list(range(30))))
    on_loop(allocator.preallocate("d", "t", list(range(20))))
    got = allocator.allocate("c", "t", hashes(list(range(50))), 50)  # asked differently: fresh table
    assert isinstance(got, Allocation) and len(got.block_ids) == 4
    on_loop(release_on_loop(allocator, "d"))  # the request ended before the scheduler admitted it
    on_loop(allocator.flush())
    check_agrees(allocator, on_loop, client)
    assert [s.seq_id for s in allocator.live_sequences()] == ["c"]


def test_quota_refusal_after_the_reserve(node):
    allocator, on_loop, client = node  # tenant q may hold 4 blocks
    got = allocator.allocate("s", "q", [], 20)
    assert len(got.block_ids) == 2
    allocator.end_step()
    on_loop(allocator.flush())  # reserve: 3 blocks held
    assert allocator.extend([("s", 40)]) == [held(on_loop, client, "s").block_ids[2:3]]
    allocator.end_step()
    on_loop(allocator.flush())  # reserve again: 4 blocks, the quota
    assert len(allocator.extend([("s", 64)])[0]) == 1
    allocator.end_step()
    on_loop(allocator.flush())  # the next reserve is refused (quota): nothing held beyond 4
    [refused] = allocator.extend([("s", 65)])
    assert isinstance(refused, Refusal) and refused.reason == "quota" and refused.tenant == "q"
    check_agrees(allocator, on_loop, client)


@pytest.mark.parametrize("early", [True, False])
def test_a_prompt_of_whole_blocks_decodes_its_first_token_with_no_call_and_gives_every_block_back(node, early):
    """Issue 34: the reserve of a new sequence came as a write-behind top-up, so a prompt filling
    its blocks exactly found none at its first decoded token and the engine's step asked
    block_service. The first allocation (early, or the engine's own ask) carries the reserve."""
    allocator, on_loop, client = node
    ids = list(range(2 * BS))
    if early:
        on_loop(allocator.preallocate("a", "t", ids))
    got = allocator.allocate("a", "t", hashes(ids), 2 * BS)
    assert isinstance(got, Allocation) and len(got.block_ids) == 2
    held_now = held(on_loop, client, "a")
    assert (len(held_now.block_ids), held_now.num_tokens) == (3, 3 * BS)  # the reserve, before any flush
    check_agrees(allocator, on_loop, client)
    rpcs = allocator.num_rpcs
    allocator.begin_step()
    assert allocator.extend([("a", 2 * BS + 1)]) == [list(held_now.block_ids[2:])]
    assert allocator.num_rpcs == rpcs and allocator.num_sync_extends == 0  # answered from the table
    allocator.end_step()
    settle(allocator, on_loop)
    allocator.release(["a"])
    holds_nothing(allocator, on_loop, client)  # every block, the reserve too


@pytest.mark.parametrize("early", [True, False])
def test_an_ask_the_reserve_takes_past_the_quota_is_admitted_without_it(node, early):
    """Tenant q may hold 4 blocks: a 4-block prompt asked with its reserve (5) is refused for the
    quota, then asked without it and admitted; its reserve is topped up when it fits."""
    allocator, on_loop, client = node
    ids = list(range(4 * BS))
    if early:
        on_loop(allocator.preallocate("s", "q", ids))
        assert [(s.seq_id, s.num_tokens) for s in allocator.live_sequences()] == [("s", 4 * BS)]
    calls = allocator.num_sync_allocates
    got = allocator.allocate("s", "q", hashes(ids, "q"), 4 * BS)
    assert isinstance(got, Allocation) and len(got.block_ids) == 4
    assert allocator.num_sync_allocates - calls == (0 if early else 2)  # early: retried on the loop
    allocator.end_step()
    settle(allocator, on_loop)  # its top-up is refused (the quota): nothing held beyond 4
    check_agrees(allocator, on_loop, client)
    assert len(held(on_loop, client, "s").block_ids) == 4


def test_an_ask_short_by_more_than_its_reserve_is_not_asked_again(node):
    """Tenant q may hold 4 blocks: a 5-block prompt is refused with or without its reserve, so the
    engine's step makes one call for it, as before the reserve."""
    allocator, on_loop, client = node
    ids = list(range(5 * BS))
    refused = allocator.allocate("s", "q", hashes(ids, "q"), 5 * BS)
    assert isinstance(refused, Refusal) and refused.reason == "quota"
    assert allocator.num_sync_allocates == 1 and allocator.live_sequences() == []


def settle(allocator, on_loop):
    """Wait until a flush that ``end_step`` may have kicked off has finished."""

    on_loop(allocator.settle())


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


def test_decode_bookkeeping_waits_for_company_yet_the_reserve_never_runs_dry(node, monkeypatch):
    allocator, on_loop, client = node
    for module in ("kvfleet.compute_service.blocks.sender", "kvfleet.compute_service.blocks.remote_allocator"):
        # the bridge's clock stands still: no pace measured, top-ups go TOPUP_MARGIN steps ahead
        monkeypatch.setattr(f"{module}.time", types.SimpleNamespace(monotonic=lambda: 0.0))
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
    check_agrees(allocator, on_loop, client)
    assert held(on_loop, client, "a").num_committed == 7  # each within DEFER_STEPS steps
    # A block crossed costs a top-up in one step and a commit in the next: 13 calls if each step's
    # bookkeeping went on its own. Deferred, a crossing's two ride together with the next due top-up.
    assert allocator.num_rpcs - start <= 8


def test_releases_and_prompt_commits_are_sent_at_the_end_of_their_step(node):
    allocator, on_loop, client = node
    ids = list(range(40))  # two full prompt blocks
    allocator.allocate("p", "t", hashes(ids), 40)
    allocator.end_step()
    settle(allocator, on_loop)
    rpcs = allocator.num_rpcs
    prompt = block_hashes(ids, BS, tenant_extra_key("t"))
    decode_step(allocator, on_loop, "p", 41, [("p", 0, prompt[0]), ("p", 1, prompt[1])])
    assert allocator.num_rpcs == rpcs + 1  # findable by the next request now:
    assert allocator.allocate("q", "t", hashes(ids + [7]), 41).num_cached_blocks == 2
    rpcs = allocator.num_rpcs
    allocator.begin_step()
    allocator.release(["p"])
    allocator.end_step()
    settle(allocator, on_loop)
    assert allocator.num_rpcs == rpcs + 1
    assert [s.seq_id for s in allocator.live_sequences()] == ["q"]
    check_agrees(allocator, on_loop, client)


def test_a_tenant_at_its_quota_crossing_blocks_while_its_topups_are_queued(node):
    """The exact extend after a refused one-block-ahead ask asked block_service to shrink
    sequences whose queued top-ups the same call had just had granted; block_service refused with
    an error, which killed the node's step thread. Tenant q may hold 4 blocks."""
    allocator, on_loop, client = node
    for seq_id in ("s1", "s2"):
        assert len(allocator.allocate(seq_id, "q", [], 16).block_ids) == 1  # each queues its reserve
    # both cross into their second block before a step's end sent the top-ups
    new = allocator.extend([("s1", 17), ("s2", 17)])
    assert new == [held(on_loop, client, "s1").block_ids[1:], held(on_loop, client, "s2").block_ids[1:]]
    assert all(len(blocks) == 1 for blocks in new)
    check_agrees(allocator, on_loop, client)
    [refused, _] = allocator.extend([("s1", 33), ("s2", 32)])  # the quota is spent: an answer, not an error
    assert isinstance(refused, Refusal) and refused.reason == "quota"


def holds_nothing(allocator, on_loop, client) -> None:
    """Once what the allocator queued is sent, block_service holds no sequence and no block of it."""
    on_loop(allocator.settle())
    on_loop(allocator.flush())
    nodes, _ = on_loop(client.stats(["n0"]))
    assert (nodes[0].num_sequences, nodes[0].num_used) == (0, 0)
    assert allocator.live_sequences() == []


@pytest.mark.parametrize("moment", ["queued", "in flight", "answered"])
def test_a_request_ended_before_the_engine_claimed_it_leaves_nothing(node, moment):
    """19 of 80 requests cancelled 12-76 ms after sending kept their early allocation.
    The request's stream ends (the allocator's release, on the loop) while its early allocation is
    queued behind a flush in flight, is itself in flight, or has been answered."""
    allocator, on_loop, client = node
    asks = allocator.client
    ids = list(range(40))

    async def scenario():
        asks.hold()
        if moment == "queued":  # another request's ask is in flight: this one waits its turn
            other = asyncio.create_task(allocator.preallocate("x", "t", list(range(20))))
            await asks.in_flight.wait()
        task = asyncio.create_task(allocator.preallocate("a", "t", ids))
        if moment == "in flight":
            await asks.in_flight.wait()
        elif moment == "queued":
            await asyncio.sleep(0)  # its preallocate has queued the ask
        else:
            asks.let_go()
            await task
        allocator.release_unclaimed(["a"])  # the request's stream ended
        if moment == "queued":
            asks.let_go()
            await other
            allocator.release_unclaimed(["x"])
        elif moment == "in flight":
            asks.let_go()
        await task

    on_loop(scenario())
    holds_nothing(allocator, on_loop, client)


def test_a_request_ended_after_the_engine_claimed_it_is_released_by_the_engine(node):
    allocator, on_loop, client = node
    ids = list(range(40))
    on_loop(allocator.preallocate("a", "t", ids))
    assert allocator.allocate("a", "t", hashes(ids), 40).block_ids  # the engine claims it
    on_loop(release_on_loop(allocator, "a"))  # the stream ends: the engine may be mid-step on it
    on_loop(allocator.settle())
    assert tuple(held(on_loop, client, "a").block_ids) == allocator.live_sequences()[0].block_ids
    allocator.release(["a"])  # the engine, when the request's abort reaches it
    holds_nothing(allocator, on_loop, client)


def test_a_stream_closing_during_preallocation_cancels_its_waiters_and_leaks_nothing(node):
    """``InvalidStateError: invalid state`` at ``done.set_result(None)`` when a Serve
    stream closed during preallocation: the answer came for a waiter already cancelled, and the
    other requests of that batch never got theirs."""
    allocator, on_loop, client = node
    asks = allocator.client

    async def scenario():
        asks.hold()
        first = asyncio.create_task(allocator.preallocate("a", "t", list(range(40))))
        second = asyncio.create_task(allocator.preallocate("b", "t", list(range(20))))
        await asks.in_flight.wait()  # both in one AllocateMany
        first.cancel()  # the stream closed: its starting tasks are cancelled
        asks.let_go()
        await second
        await allocator.settle()
        assert [s.seq_id for s in allocator.live_sequences()] == ["b"]
        allocator.release_unclaimed(["a", "b"])  # the stream's requests end
        with pytest.raises(asyncio.CancelledError):
            await first

    on_loop(scenario())
    holds_nothing(allocator, on_loop, client)


def test_block_service_gone_never_reaches_the_engine_thread_on_write_behind_paths(node, served, caplog):
    """Commits, releases and step ends only queue: a flush block_service cannot take is logged
    on the loop (once: the link is down, the batch waits for the resync), and the step goes on."""
    allocator, on_loop, _ = node
    ids = list(range(40))
    allocator.allocate("a", "t", hashes(ids), 40)
    served.stop()
    allocator.begin_step()
    allocator.commit([("a", 0, block_hashes(ids, BS, tenant_extra_key("t"))[0])])
    allocator.release(["a"])
    allocator.end_step()
    on_loop(allocator.settle())
    assert caplog.text.count("block_service is unreachable") == 1
    assert allocator.live_sequences() == []
