"""The compact storage behind the page table: the LRU threaded through two arrays, the
shared prefix index with its bitsets, and the snapshot form of a pool, old and new."""

from __future__ import annotations

import pytest

from kvfleet.block_service.eviction.lru import BlockLru
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.prefix_index import PrefixIndex, slots_of
from kvfleet.block_service.snapshot import decode_snapshot, encode_snapshot
from kvfleet.core.allocator import AllocateRequest


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_lru_keeps_order_through_appends_removals_and_pops() -> None:
    lru = BlockLru(8)
    lru.extend([3, 1, 6])
    lru.append(0)
    lru.remove(1)
    assert list(lru) == [3, 6, 0] and len(lru) == 3
    assert 6 in lru and 1 not in lru
    assert lru.pop_oldest() == 3
    lru.remove(0)
    assert list(lru) == [6]
    assert lru.pop_oldest() == 6 and list(lru) == [] and len(lru) == 0
    lru.extend([5, 2, 4])
    assert [lru.pop_oldest(), lru.pop_oldest()] == [5, 2] and list(lru) == [4] and 5 not in lru and 2 not in lru


def test_lru_order_is_what_a_snapshot_restores() -> None:
    """A snapshot holds the order (stale entries left out); the list restored from it pops the same."""
    a = BlockLru(6)
    a.extend([0, 1, 2, 3])
    a.remove(1)
    assert a.pop_oldest() == 0
    b = BlockLru.from_order(6, a.order())
    assert list(a) == list(b) == [2, 3] and len(b) == 2 and 1 not in b and 3 in b
    assert [b.pop_oldest(), b.pop_oldest()] == [a.pop_oldest(), a.pop_oldest()] == [2, 3]


def test_slots_of_lists_the_set_bits() -> None:
    assert slots_of(0) == [] and slots_of(1 << 999) == [999]
    assert slots_of((1 << 0) | (1 << 5) | (1 << 64)) == [0, 5, 64]


def test_index_entry_grows_to_shared_and_back_to_one_holder() -> None:
    index = PrefixIndex()
    assert index.add(h(1), 0, 7) and not index.add(h(1), 0, 9)  # a node indexes a hash once
    for slot in (1, 2):
        assert index.add(h(1), slot, 10 + slot)
    assert index.holders(h(1)) == {0: 7, 1: 11, 2: 12} and index.num_pairs == 3
    index.remove(h(1), 1)
    assert index.match([h(1)]) == {0: 1, 2: 1}  # the removed node's bit is gone
    index.remove(h(1), 0)
    assert index.holders(h(1)) == {2: 12} and index.block(h(1), 2) == 12 and index.block(h(1), 0) is None
    index.check()
    index.remove(h(1), 2)
    assert len(index) == 0 and index.num_pairs == 0


def test_match_counts_each_nodes_leading_run() -> None:
    index = PrefixIndex()
    for slot in range(300):  # every node holds the first two blocks; node 7 holds three
        index.add(h(0), slot, 0)
        index.add(h(1), slot, 1)
    index.add(h(2), 7, 2)
    index.add(h(3), 8, 3)  # not a prefix: node 8 misses block 2
    assert index.match([h(0), h(1), h(2), h(3)]) == {**dict.fromkeys(range(300), 2), 7: 3}
    assert index.match([h(1)]) == dict.fromkeys(range(300), 1)
    assert index.match([h(9), h(0)]) == {}


def _table_with_history() -> PageTable:
    table = PageTable()
    table.register_node("a", 6, 16, 1 << 18)
    table.register_node("b", 4, 16, 1 << 18)
    prompt = [h(i) for i in range(3)]
    for n, (node, tenant) in enumerate([("a", "x"), ("a", "y"), ("b", "x")]):
        table.allocate_many([AllocateRequest(node, f"s{n}", tenant, prompt, 48)])
        table.commit([(f"s{n}", i, prompt[i]) for i in range(3)])
    table.release(["s2"])
    table.allocate_many([AllocateRequest("b", "s3", "y", [h(7)], 32)])  # evicts from b's cache
    return table


def test_snapshot_round_trip_keeps_pools_and_index() -> None:
    table = _table_with_history()
    _, d = decode_snapshot(encode_snapshot(7, table.to_dict()))
    restored = PageTable.from_dict(d)
    restored.check()
    assert restored.to_dict() == table.to_dict()
    assert restored.match_prefix([h(0), h(1), h(2)]) == table.match_prefix([h(0), h(1), h(2)]) == {"a": 3, "b": 2}


def test_a_snapshot_of_the_first_format_still_loads() -> None:
    """Snapshots written before the compact form: one JSON value per block and field."""
    old_pool = {
        "shape": [4, 16, 1 << 18], "ref": [1, 0, 0, 0], "hash": [h(1).hex(), h(2).hex(), None, None],
        "owner": ["x", None, None, None], "free": [3, 2], "cached": [1], "index": [[h(1).hex(), 0], [h(2).hex(), 1]],
    }
    state = {"tenants": [], "nodes": {"a": {"pool": old_pool, "ledger": {"charged": {"x": 1}, "grace": {}}}},
             "sequences": [["s", "a", "x", [0], 16, 1]]}
    table = PageTable.from_dict(state)
    table.check()
    assert table.match_prefix([h(1), h(2)]) == {"a": 2}
    stats = table.node_stats("a")
    assert (stats.num_free, stats.num_cached, stats.num_used) == (2, 1, 1)
    alloc = table.allocate_many([AllocateRequest("a", "t", "x", [h(9)], 48)])[0]
    assert alloc.block_ids == [2, 3, 1]  # free stack first (2 then 3), then the cached block evicted
    assert table.match_prefix([h(1), h(2)]) == {"a": 1}


@pytest.mark.parametrize("field", ["hashed", "hashes"])
def test_a_pool_whose_hashes_do_not_match_their_blocks_is_refused(field: str) -> None:
    d = _table_with_history().to_dict()
    pool = d["nodes"]["a"]["pool"]
    other = PageTable()
    other.register_node("z", 6, 16, 1 << 18)
    pool[field] = other.to_dict()["nodes"]["z"]["pool"][field]  # no hashes at all
    with pytest.raises(ValueError, match="differ in number"):
        PageTable.from_dict(d)
