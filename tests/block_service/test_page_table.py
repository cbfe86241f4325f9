"""The pure core: prefix reuse, LRU eviction order, refusals that change nothing, commit rules."""

from __future__ import annotations

import logging

import pytest

from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal
from kvfleet.core.block_hash import block_hashes
from kvfleet.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)

BS = 16


def hashes(n_blocks: int, salt: int = 0) -> list[bytes]:
    return block_hashes([salt * 1000 + i for i in range(n_blocks * BS)], BS, seed=b"test")


@pytest.fixture
def table() -> PageTable:
    t = PageTable()
    t.register_node("n0", 8, BS, 4096)
    return t


def allocate_committed(table: PageTable, seq_id: str, hs: list[bytes], tenant: str = "a") -> Allocation:
    alloc = table.allocate("n0", seq_id, tenant, hs, len(hs) * BS)
    assert isinstance(alloc, Allocation)
    table.commit([(seq_id, i, h) for i, h in enumerate(hs)])
    return alloc


def test_prefix_reuse_after_release(table: PageTable) -> None:
    hs = hashes(3)
    first = allocate_committed(table, "s1", hs)
    table.release(["s1"])
    assert table.allocator_stats("n0").num_cached == 3
    again = table.allocate("n0", "s2", "a", hs[:2], 3 * BS + 5)
    assert again.block_ids[:2] == first.block_ids[:2] and again.num_cached_blocks == 2
    assert len(again.block_ids) == 4
    table.check()


def test_lookup_stops_at_first_miss_and_ignores_uncommitted(table: PageTable) -> None:
    hs = hashes(3)
    table.allocate("n0", "s1", "a", hs, 3 * BS)
    table.commit([("s1", 0, hs[0]), ("s1", 2, hs[2])])
    assert table.match_prefix(hs) == {"n0": 1}
    alloc = table.allocate("n0", "s2", "a", hs, 3 * BS)
    assert alloc.num_cached_blocks == 1
    table.check()


def test_shared_block_is_referenced_twice_and_survives_one_release(table: PageTable) -> None:
    hs = hashes(2)
    a = allocate_committed(table, "s1", hs)
    b = table.allocate("n0", "s2", "a", hs, 2 * BS + 1)
    assert b.block_ids[:2] == a.block_ids
    table.release(["s1"])
    assert table.allocator_stats("n0").num_used == 3
    table.check()


def test_release_reverse_order_evicts_deepest_block_first(table: PageTable) -> None:
    hs = hashes(4)
    allocate_committed(table, "s1", hs)
    table.release(["s1"])
    table.allocate("n0", "filler", "a", [], 4 * BS)  # takes the 4 free blocks
    table.allocate("n0", "s2", "a", [], 1)           # evicts one cached block
    assert table.match_prefix(hs) == {"n0": 3}       # the deepest went first
    table.check()


def test_refusal_changes_nothing_and_logs_holders(table: PageTable, caplog: pytest.LogCaptureFixture) -> None:
    table.allocate("n0", "s1", "a", [], 6 * BS)
    before = table.to_dict()
    with caplog.at_level(logging.WARNING):
        r = table.allocate("n0", "s2", "b", [], 3 * BS)
    assert r == Refusal("pool", "n0", "b", 3, 6, 8)
    assert "block_pool exhausted (alloc=6/8) node=n0 tenant=b" in caplog.text
    assert "tenant=a sequences=1 blocks=6" in caplog.text
    assert table.to_dict() == before
    assert table.node_stats("n0").counters.refusals_pool == 1


def test_extend_grows_per_sequence_and_refuses_alone(table: PageTable) -> None:
    table.allocate("n0", "s1", "a", [], BS)
    table.allocate("n0", "s2", "a", [], BS)
    out = table.extend([("s1", 2 * BS), ("s2", 10 * BS), ("s1", 2 * BS)][:2])
    assert out[0] == [2] and isinstance(out[1], Refusal) and out[1].blocks_asked == 9
    assert table.sequence("s2").num_tokens == BS
    assert table.extend([("s1", 2 * BS)]) == [[]]
    with pytest.raises(InvalidArgument):
        table.extend([("s1", 1)])
    table.check()


def test_commit_rules(table: PageTable) -> None:
    hs = hashes(2)
    other = hashes(1, salt=7)
    table.allocate("n0", "s1", "a", [], 2 * BS - 1)
    assert table.commit([("s1", 0, hs[0])]) == 1
    assert table.commit([("s1", 0, hs[0])]) == 0  # same hash again: no-op
    with pytest.raises(FailedPrecondition):
        table.commit([("s1", 0, other[0])])
    with pytest.raises(InvalidArgument, match="block 2 is not one of them"):
        table.commit([("s1", 2, hs[1])])
    with pytest.raises(InvalidArgument):
        table.commit([("s1", 0, b"short")])
    # a second block with the same content stays unindexed and is freed, not cached, on release
    table.allocate("n0", "s2", "a", [], BS)
    table.commit([("s2", 0, hs[0])])
    table.release(["s2"])
    stats = table.allocator_stats("n0")
    assert (stats.num_cached, stats.num_used) == (0, 2)
    table.check()


def test_a_commit_declares_its_block_full(table: PageTable) -> None:
    """In a soak (~9 refused commits a minute under a small-tenant flood), a sequence whose
    reserve top-up was refused keeps the prompt's length here, inside its last block; when the
    engine has filled that block, its commit used to be refused as "not a full block" (the prefix
    hit lost). The commit now grows the length to the block's end: no new block, no quota."""
    hs = hashes(3)
    table.allocate("n0", "s1", "a", hs[:2], 40)       # 40 tokens: blocks 0, 1 full, block 2 not
    table.commit([("s1", 0, hs[0]), ("s1", 1, hs[1])])
    assert table.commit([("s1", 2, hs[2])]) == 1      # the engine filled block 2
    assert table.sequence("s1").num_tokens == 3 * BS and len(table.sequence("s1").block_ids) == 3
    table.release(["s1"])
    assert table.match_prefix(hs) == {"n0": 3}          # the whole prefix is findable
    table.check()


def test_batch_with_one_bad_item_changes_nothing(table: PageTable) -> None:
    table.allocate("n0", "s1", "a", [], BS)
    before = table.to_dict()
    with pytest.raises(NotFound):
        table.allocate_many([AllocateRequest("n0", "s2", "a", [], BS), AllocateRequest("nX", "s3", "a", [], BS)])
    with pytest.raises(AlreadyExists):
        table.allocate_many([AllocateRequest("n0", "s2", "a", [], BS), AllocateRequest("n0", "s1", "a", [], BS)])
    with pytest.raises(NotFound):
        table.extend([("s1", 3 * BS), ("nope", 1)])
    with pytest.raises(NotFound):
        table.release(["s1", "nope"])
    with pytest.raises(InvalidArgument):
        table.release(["s1", "s1"])
    with pytest.raises(InvalidArgument):
        table.allocate("n0", "s4", "a", [hashes(1)[0]] * 2, 2 * BS)
    with pytest.raises(InvalidArgument):
        table.allocate("n0", "s4", "a", [], -1)
    assert table.to_dict() == before


def test_tenant_cannot_touch_another_tenants_sequence(table: PageTable) -> None:
    table.allocate("n0", "s1", "a", [], BS)
    for call in (lambda: table.extend([("s1", 40)], tenant="b"),
                 lambda: table.release(["s1"], tenant="b"),
                 lambda: table.commit([("s1", 0, hashes(1)[0])], tenant="b")):
        with pytest.raises(PermissionDenied):
            call()
    table.release(["s1"], tenant="a")


def test_register_and_deregister_node(table: PageTable) -> None:
    assert table.register_node("n0", 8, BS, 4096) is False
    with pytest.raises(AlreadyExists):
        table.register_node("n0", 9, BS, 4096)
    with pytest.raises(InvalidArgument):
        table.register_node("n1", 8, 24, 4096)
    table.register_node("n1", 4, 32, 4096)
    table.allocate("n1", "s1", "a", [], 40)
    table.allocate("n0", "s2", "a", [], 40)
    assert table.deregister_node("n1") == ["s1"]
    with pytest.raises(NotFound):
        table.sequence("s1")
    assert table.node_ids() == ["n0"]
    table.check()


def test_match_prefix_per_node() -> None:
    t = PageTable()
    for n in ("a", "b"):
        t.register_node(n, 8, BS, 4096)
    hs = hashes(3)
    t.allocate("a", "s1", "x", hs, 3 * BS)
    t.commit([("s1", i, h) for i, h in enumerate(hs)])
    t.allocate("b", "s2", "x", hs, 3 * BS)
    t.commit([("s2", 0, hs[0])])
    before = t.to_dict()
    assert t.match_prefix(hs) == {"a": 3, "b": 1}
    assert t.match_prefix(hs, ["b"]) == {"b": 1}
    assert t.to_dict() == before


def test_stats_fragmentation(table: PageTable) -> None:
    table.allocate("n0", "s1", "a", [], BS + 4)
    s = table.node_stats("n0")
    assert (s.tokens_stored, s.token_capacity) == (BS + 4, 2 * BS)
    assert s.fragmentation == pytest.approx(1 - (BS + 4) / (2 * BS))


def test_to_dict_round_trip_is_exact(table: PageTable) -> None:
    hs = hashes(3)
    allocate_committed(table, "s1", hs)
    table.allocate("n0", "s2", "a", hs[:1], 2 * BS)
    table.release(["s1"])
    restored = PageTable.from_dict(table.to_dict())
    restored.check()
    assert restored.to_dict() == table.to_dict()
    # and it behaves the same afterwards (same free list and LRU order)
    for t in (table, restored):
        t.allocate("n0", "s3", "a", [], 7 * BS)
    assert restored.to_dict() == table.to_dict()
