"""ApplyMany's core: a node's bookkeeping applied item by item, each bad item refused alone, and a
log that replays to the same state."""

from __future__ import annotations

from kvfleet.block_service.bookkeeping import ItemError
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.recovery import recover
from kvfleet.core.allocator import AllocateRequest, Refusal

H = [bytes([i] * 16) for i in range(1, 6)]


def _store(tmp_path) -> DurablePageTable:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("n0", 6, 16, 1 << 16)
    store.allocate_many([AllocateRequest("n0", s, t, [], n)
                         for s, t, n in (("a", "t", 16), ("b", "t", 20), ("c", "u", 16))])
    return store


def _replays_to_the_same_state(store: DurablePageTable, tmp_path) -> None:
    store.sync()
    replayed, report = recover(str(tmp_path))
    assert report.stop_reason is None and replayed.to_dict() == store.table.to_dict()
    store.table.check()


def test_every_kind_of_bad_item_is_refused_alone(tmp_path) -> None:
    store = _store(tmp_path)
    result = store.apply(
        growth=[("b", 40), ("b", 48), ("nope", 5), ("a", 200)],  # twice, unknown, pool full
        commits=[("a", 0, H[0]), ("b", 1, H[1]), ("b", 3, H[2]), ("a", 0, H[3]), ("a", 0, H[0])],
        releases=["c", "c", "ghost"],
    )
    assert [(e.kind, e.index, e.code) for e in result.errors] == [
        ("growth", 1, "INVALID_ARGUMENT"), ("growth", 2, "NOT_FOUND"),
        ("commit", 2, "INVALID_ARGUMENT"), ("commit", 3, "FAILED_PRECONDITION"),
        ("release", 1, "INVALID_ARGUMENT"), ("release", 2, "NOT_FOUND"),
    ]
    assert isinstance(result.growth[0], list) and isinstance(result.growth[3], Refusal)
    assert result.growth[1:3] == result.errors[:2] and all(isinstance(g, ItemError) for g in result.growth[1:3])
    assert result.num_committed == 2  # the repeat of ("a", 0, H[0]) names nothing new
    assert "appears twice" in result.errors[0].message and "'ghost'" in result.errors[-1].line()
    assert store.table.sequence("b").num_tokens == 40 and store.table.match_prefix([H[0]]) == {"n0": 1}
    assert store.table.node_stats("n0").num_sequences == 2
    _replays_to_the_same_state(store, tmp_path)


def test_another_tenants_items_are_refused_alone(tmp_path) -> None:
    store = _store(tmp_path)
    result = store.apply(growth=[("c", 32), ("a", 32)], commits=[], releases=["c", "b"], tenant="t")
    assert [(e.kind, e.index, e.seq_id, e.code) for e in result.errors] == [
        ("growth", 0, "c", "PERMISSION_DENIED"), ("release", 0, "c", "PERMISSION_DENIED"),
    ]
    assert store.table.sequence("a").num_tokens == 32 and store.table.sequence("c").num_tokens == 16
    _replays_to_the_same_state(store, tmp_path)


def test_a_batch_with_nothing_applied_writes_no_record(tmp_path) -> None:
    store = _store(tmp_path)
    lsn = store.lsn
    result = store.apply(growth=[("nope", 1)], commits=[("a", 3, H[0])], releases=["ghost"])
    assert len(result.errors) == 3 and store.lsn == lsn
