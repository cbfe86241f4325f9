"""A node rides out block_service's trouble: while block_service is unreachable the
engine's calls get a transient refusal at once and bookkeeping waits; when it is back, with its
state or without, one sync makes its view of the node equal to the node's live sequences.

block_service is a real server on the test's loop (served_blocks.py), stopped and started again
on the same port; the calling thread stands in for the engine's step loop.
"""

from __future__ import annotations

import asyncio
import time

from kvfleet.compute_service.blocks import sender
from kvfleet.core.allocator import Allocation, Refusal
from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from tests.compute_service.served_blocks import BS, check_agrees, hashes


def wait_up(allocator, on_loop, timeout: float = 30.0) -> None:
    """Until the resync brought the link up (a deadline, not a timing assertion)."""
    async def up():
        deadline = time.monotonic() + timeout
        while not allocator.link.up or allocator.syncs.resyncing:
            assert time.monotonic() < deadline, "the node never resynced with block_service"
            await asyncio.sleep(0.05)
        await allocator.settle()

    on_loop(up())


def node_sequences(on_loop, client) -> int:
    nodes, _ = on_loop(client.stats(["n0"]))
    return nodes[0].num_sequences


def test_while_block_service_is_down_calls_are_refused_transiently_and_it_agrees_afterwards(node, served):
    allocator, on_loop, client = node
    a, b = list(range(40)), list(range(100, 120))
    assert isinstance(allocator.allocate("a", "t", hashes(a), 40), Allocation)
    assert isinstance(allocator.allocate("b", "t", hashes(b), 20), Allocation)
    on_loop(allocator.flush())  # the reserves' top-ups
    served.stop()

    allocator.begin_step()  # "a" finished, "b" decoded into its reserve and needs more
    allocator.commit([("a", 1, block_hashes(a, BS, tenant_extra_key("t"))[1])])
    allocator.release(["a"])
    [b_live] = allocator.live_sequences()
    reserve = b_live.block_ids[2]
    assert allocator.extend([("b", 33)]) == [[reserve]]  # no network: the reserve
    refused = allocator.extend([("b", 49)])[0]
    assert isinstance(refused, Refusal) and refused.transient
    allocator.end_step()
    got = allocator.allocate("c", "t", [], 30)  # at once, without the network: the link is down
    assert isinstance(got, Refusal) and got.transient and not allocator.link.up

    served.restart(keep_state=True)  # as after a restart that replayed its log
    wait_up(allocator, on_loop)
    assert [s.seq_id for s in allocator.live_sequences()] == ["b"]
    check_agrees(allocator, on_loop, client)  # "a" released by the sync, "b" as the node holds it
    assert node_sequences(on_loop, client) == 1
    grown = allocator.extend([("b", 49)])[0]  # served again
    assert isinstance(grown, list) and grown
    check_agrees(allocator, on_loop, client)
    served.table.check()


def test_block_service_that_lost_the_node_gets_its_pool_and_sequences_back(node, served):
    allocator, on_loop, client = node
    ids = list(range(40))
    allocator.allocate("a", "t", hashes(ids), 40)
    on_loop(allocator.settle())
    served.restart(keep_state=False)  # as if the router dropped the pool after a lease expiry
    answer = allocator.extend([("a", 65)])[0]  # past the reserve: block_service says NOT_FOUND
    assert isinstance(answer, Refusal) and answer.transient
    wait_up(allocator, on_loop)
    check_agrees(allocator, on_loop, client)
    assert isinstance(allocator.extend([("a", 65)])[0], list)
    check_agrees(allocator, on_loop, client)
    served.table.check()


def test_reconciliation_releases_what_the_node_no_longer_has(node, served):
    allocator, on_loop, client = node
    allocator.allocate("a", "t", hashes(list(range(20))), 20)
    on_loop(client.allocate("n0", "leaked", "t", [], 30))  # as if a release had been lost
    outcome = on_loop(allocator.sync(periodic=True))
    assert outcome.released == ["leaked"] and not outcome.adopted and not outcome.updated
    assert allocator.link.num_reconciled == 1
    check_agrees(allocator, on_loop, client)
    assert node_sequences(on_loop, client) == 1


def test_sequences_block_service_refuses_after_a_sync_are_failed_in_the_engine(node, served):
    allocator, on_loop, client = node
    failed: list[tuple[list[str], str]] = []
    allocator.on_refused = lambda seq_ids, why: failed.append((seq_ids, why))
    allocator.allocate("x", "t", hashes(list(range(20))), 20)
    on_loop(allocator.settle())
    served.restart(keep_state=False)
    on_loop(client.register_node("n1", 64, BS, 1024))
    on_loop(client.allocate("n1", "x", "t", [], 20))  # the same id, live on another node now
    on_loop(allocator.sync())
    assert failed and failed[0][0] == ["x"] and "could not hold" in failed[0][1]
    allocator.release(["x"])  # the engine, failing the request
    on_loop(allocator.settle())
    assert allocator.live_sequences() == []
    assert node_sequences(on_loop, client) == 0
    served.table.check()



def test_early_asks_taken_by_an_engine_call_that_timed_out_are_answered(node, served, monkeypatch):
    """An engine call first sends what is queued, early allocations included. When block_service
    does not answer it in time, its wait is cut where it stands: the early asks it had taken were
    then never answered, and their requests never reached the engine (their preallocation waited
    until the client gave up). They are answered "not now": each asks again when admitted."""
    monkeypatch.setattr(sender, "ANSWER_TIMEOUT_S", 0.5)
    allocator, on_loop, client = node
    asks = allocator.client
    arrived: list = []

    def trace_context_of(seq_id: str):
        """Called on the engine thread just before its call goes to the loop: a request arrives
        then, so its early ask is queued when that call sends what is queued (the loop runs the
        arrival, then the call, then the arrival's own flush, in that order)."""
        if not arrived:
            arrived.append(asyncio.run_coroutine_threadsafe(
                allocator.preallocate("a", "t", list(range(40))), served.loop))
        return None

    allocator.trace_context_of = trace_context_of
    asks.hold()  # the AllocateMany of the engine's call is not answered
    answer = allocator.allocate("b", "t", [], 20)
    assert isinstance(answer, Refusal) and answer.transient
    arrived[0].result(10)  # a deadline, not a timing assertion: it waited for ever
    asks.let_go()
    wait_up(allocator, on_loop)
    check_agrees(allocator, on_loop, client)
    assert node_sequences(on_loop, client) == 0
