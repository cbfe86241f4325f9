"""``drop_front``: a sliding-window sequence gives back its leading blocks. Committed ones are cached
(a later prompt with the same prefix still hits), the table keeps its positions, the invariants hold,
the call is idempotent, and ApplyMany's drops are applied item by item, logged and replayed."""

from __future__ import annotations

import pytest

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.node_sync import LiveSequence
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import recover
from kvfleet.core.allocator import DROPPED, AllocateRequest, Allocation
from kvfleet.core.errors import FailedPrecondition, InvalidArgument

BS = 16
H = [bytes([i]) * 16 for i in range(1, 9)]


@pytest.fixture
def table() -> PageTable:
    t = PageTable()
    t.register_node("n0", 8, BS, 4096)
    return t


def test_dropped_blocks_are_given_back_committed_ones_cached(table: PageTable) -> None:
    alloc = table.allocate("n0", "s", "a", [], 5 * BS - 3)
    assert isinstance(alloc, Allocation)
    table.commit([("s", i, H[i]) for i in range(3)])
    table.drop_front([("s", 4)])  # blocks 0-2 committed, block 3 full but not committed
    table.check()
    seq = table.sequence("s")
    assert seq.block_ids == [DROPPED] * 4 + alloc.block_ids[4:] and seq.num_dropped == 4
    stats = table.allocator_stats("n0")
    assert (stats.num_used, stats.num_cached, stats.num_free) == (1, 3, 4)
    assert table.match_prefix(H[:3]) == {"n0": 3}  # still found: cached, not freed
    table.drop_front([("s", 2)])  # fewer than dropped already: nothing changes
    table.drop_front([("s", 4)])
    assert table.allocator_stats("n0") == stats
    table.extend([("s", 6 * BS)])
    table.release(["s"])
    table.check()
    assert table.allocator_stats("n0").num_used == 0


def test_only_full_blocks_can_be_dropped_and_dropped_blocks_not_committed(table: PageTable) -> None:
    table.allocate("n0", "s", "a", [], 2 * BS + 1)
    with pytest.raises(InvalidArgument, match="only full blocks"):
        table.drop_front([("s", 3)])
    table.drop_front([("s", 1)])
    with pytest.raises(FailedPrecondition, match="given back"):
        table.commit([("s", 0, H[0])])
    table.check()


def test_a_synced_table_with_dropped_entries_is_adopted(table: PageTable) -> None:
    result = table.sync_node("n0", 8, BS, 4096, [LiveSequence("s", "a", (DROPPED, DROPPED, 5), 40)])
    assert result.adopted == ["s"] and not result.refused
    assert table.allocator_stats("n0").num_used == 1
    table.check()
    bad = table.sync_node("n0", 8, BS, 4096, [LiveSequence("t", "a", (DROPPED, DROPPED, 6), 20)])
    assert [s for s, _ in bad.refused] == ["t"]  # two dropped blocks cannot come from 20 tokens


def test_apply_many_drops_item_by_item_and_the_log_replays(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("n0", 8, BS, 4096)
    store.allocate_many([AllocateRequest("n0", s, "t", [], 3 * BS) for s in ("a", "b")])
    result = store.apply(growth=[("a", 4 * BS)], commits=[("a", 0, H[0]), ("a", 3, H[3])], releases=["b"],
                         drops=[("a", 4), ("ghost", 1), ("b", 9)])
    assert [(e.kind, e.index, e.code) for e in result.errors] == [
        ("drop", 1, "NOT_FOUND"), ("drop", 2, "INVALID_ARGUMENT")]
    assert store.table.sequence("a").num_dropped == 4 and store.table.match_prefix([H[0]]) == {"n0": 1}
    store.sync()
    replayed, report = recover(str(tmp_path))
    assert report.stop_reason is None and replayed.to_dict() == store.table.to_dict()
    replayed.check()
    store.close()
