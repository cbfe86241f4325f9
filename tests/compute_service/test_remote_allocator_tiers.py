"""The remote allocator's lower-tier moves against a real BlockManager server: sent with the
step's bookkeeping, refusals (cap, bad move) handed back to the node, the node's whole index re-sent
by a sync after block_service lost its state, and moves recorded while it was away not lost.

The server and the node's two threads are set up in served_blocks.py.
"""

from __future__ import annotations

from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, TierChange
from kvfleet.core.tenants import Tenant
from tests.compute_service.served_blocks import BYTES_PER_BLOCK, hashes
from tests.compute_service.test_block_outage import wait_up


def by_hash(changes):
    return sorted(changes, key=lambda c: c.block_hash)


def test_moves_go_with_the_step_and_refusals_come_back(node, served):
    allocator, on_loop, client = node
    on_loop(client.configure_tenants([Tenant("c", lower_tier_quota_mib=2 * BYTES_PER_BLOCK / 2**20)]))
    hs = hashes(list(range(100)), "c")
    moves = [TierChange(hs[0], "c", TIER_HOST), TierChange(hs[1], "c", TIER_DISK),
             TierChange(hs[2], "c", TIER_HOST),      # past the cap of 2 blocks
             TierChange(hs[3], "", TIER_HOST)]       # no tenant: a bad move, refused alone
    allocator.begin_step()
    allocator.record_tiers(moves)
    assert allocator.take_tier_refusals() == []      # nothing sent during the step
    allocator.end_step()
    on_loop(allocator.settle())
    assert allocator.take_tier_refusals() == [hs[2], hs[3]]
    assert allocator.take_tier_refusals() == []
    assert by_hash(served.table.lower_tiers("n0")) == by_hash(moves[:2])
    assert on_loop(client.match_tiers(hs)) == ({"n0": 0}, {"n0": 2})
    allocator.record_tiers([TierChange(hs[0], "c", TIER_NONE)])  # promoted back into the pool
    allocator.end_step()
    on_loop(allocator.settle())
    assert served.table.lower_tiers("n0") == [moves[1]]


def test_a_sync_after_block_service_lost_its_state_re_sends_the_whole_index(node, served):
    allocator, on_loop, client = node
    hs = hashes(list(range(100)), "t")
    index = [TierChange(hs[0], "t", TIER_HOST), TierChange(hs[1], "t", TIER_DISK)]
    allocator.set_tier_source(lambda: list(index))
    served.restart(keep_state=False)
    allocator.record_tiers([TierChange(hs[5], "t", TIER_HOST)])  # queued; moot once the index is sent
    outcome = on_loop(allocator.sync())
    assert outcome.registered
    assert by_hash(served.table.lower_tiers("n0")) == by_hash(index)
    assert on_loop(client.match_tiers(hs)) == ({"n0": 0}, {"n0": 2})
    index.append(TierChange(hs[2], "t", TIER_HOST))  # the node's account wins at each reconciliation
    on_loop(allocator.sync(periodic=True))
    assert by_hash(served.table.lower_tiers("n0")) == by_hash(index)


def test_without_a_source_moves_recorded_while_away_follow_the_sync(node, served):
    allocator, on_loop, _ = node
    hs = hashes(list(range(40)), "t")
    served.stop()
    allocator.record_tiers([TierChange(hs[0], "t", TIER_HOST)])
    allocator.end_step()
    on_loop(allocator.settle())                      # block_service away: kept, not lost
    served.restart(keep_state=True)
    wait_up(allocator, on_loop)                      # the resync the outage started, then the queue
    on_loop(allocator.flush())
    assert served.table.lower_tiers("n0") == [TierChange(hs[0], "t", TIER_HOST)]
