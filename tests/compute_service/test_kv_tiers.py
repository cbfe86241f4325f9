"""The lower tiers' index (pure): LRU per tier, host -> disk cascade, refusals, swap room."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.kv.tier_index import POOL, Move, PrefixLookups, TierIndex
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, TierChange


def h(i: int) -> bytes:
    return bytes([i]) * 4


def test_demotion_takes_a_free_host_slot_and_records_host():
    index = TierIndex(host_blocks=2)
    plan = index.demote(h(1), "t", pool_block=7)
    assert plan.moves == [Move(POOL, 7, TIER_HOST, 0)]
    assert plan.changes == [TierChange(h(1), "t", TIER_HOST)]
    assert index.where(h(1)) == (TIER_HOST, 0)


def test_a_full_host_cascades_its_least_recent_block_to_disk_before_reusing_its_slot():
    index = TierIndex(host_blocks=2, disk_blocks=1)
    index.demote(h(1), "a", 10)
    index.demote(h(2), "b", 11)
    index.demote(h(1), "a", 12)  # already held: made most recent, nothing copied
    plan = index.demote(h(3), "c", 13)
    assert plan.moves == [Move(TIER_HOST, 1, TIER_DISK, 0), Move(POOL, 13, TIER_HOST, 1)]
    assert plan.changes == [TierChange(h(2), "b", TIER_DISK), TierChange(h(3), "c", TIER_HOST)]
    # disk full too: its LRU block is dropped, host's LRU (h1) takes its slot
    plan = index.demote(h(4), "d", 14)
    assert plan.changes == [TierChange(h(2), "b", TIER_NONE), TierChange(h(1), "a", TIER_DISK),
                            TierChange(h(4), "d", TIER_HOST)]
    assert index.where(h(2)) is None and index.where(h(1)) == (TIER_DISK, 0)


def test_without_disk_the_host_lru_block_is_dropped():
    index = TierIndex(host_blocks=1)
    index.demote(h(1), "a", 0)
    plan = index.demote(h(2), "a", 1)
    assert plan.changes == [TierChange(h(1), "a", TIER_NONE), TierChange(h(2), "a", TIER_HOST)]
    assert plan.moves == [Move(POOL, 1, TIER_HOST, 0)]


def test_a_run_stops_at_the_first_block_not_held_and_take_frees_the_slot():
    index = TierIndex(host_blocks=3)
    for i in (1, 2, 4):
        index.demote(h(i), "t", i)
    assert index.run([h(1), h(2), h(3), h(4)]) == [(TIER_HOST, 0), (TIER_HOST, 1)]
    assert index.take(h(2)) == TierChange(h(2), "t", TIER_NONE)
    assert index.take(h(2)) is None
    assert index.demote(h(5), "t", 5).moves == [Move(POOL, 5, TIER_HOST, 1)]


def test_refused_blocks_are_dropped_without_a_record():
    index = TierIndex(host_blocks=2)
    index.demote(h(1), "t", 0)
    assert index.refused([h(1), h(9)]) == 1
    assert index.entries() == []


def test_entries_name_every_block_held_and_its_tier():
    index = TierIndex(host_blocks=1, disk_blocks=1)
    index.demote(h(1), "a", 0)
    index.demote(h(2), "b", 1)
    assert sorted(index.entries(), key=lambda c: c.block_hash) == [TierChange(h(1), "a", TIER_DISK),
                                                                   TierChange(h(2), "b", TIER_HOST)]


def test_swap_room_counts_against_host_and_pushes_hashed_blocks_out():
    index = TierIndex(host_blocks=3)
    index.demote(h(1), "t", 0)
    index.demote(h(2), "t", 1)
    slots, plan = index.reserve_swap("s1", 2)
    assert len(slots) == 2 and plan.changes == [TierChange(h(1), "t", TIER_NONE)]
    assert index.reserve_swap("s2", 2) is None  # 2 of 3 slots swapped: no room for 2 more
    assert index.demote(h(3), "t", 2).changes[-1] == TierChange(h(3), "t", TIER_HOST)
    assert index.counts().swapped == 2
    index.release_swap("s1")
    assert index.counts().swapped == 0 and index.reserve_swap("s2", 2) is not None


def test_a_failed_disk_drops_what_it_held():
    index = TierIndex(host_blocks=1, disk_blocks=2)
    index.demote(h(1), "t", 0)
    index.demote(h(2), "t", 1)
    assert index.disable_disk() == [TierChange(h(1), "t", TIER_NONE)]
    assert index.counts().disk_blocks == 0
    assert index.demote(h(3), "t", 2).changes[0] == TierChange(h(2), "t", TIER_NONE)


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError):
        TierIndex(-1)


def test_lookups_count_hot_lower_and_missed_blocks():
    lookups = PrefixLookups()
    lookups.add(2, [TIER_HOST, TIER_DISK, TIER_HOST], 7)
    assert (lookups.hot, lookups.host, lookups.disk, lookups.miss) == (2, 2, 1, 2)
