"""SyncNode's core: block_service's view of a node made equal to the node's own account (after a
restart or a lost registration, and every ~30 s to reconcile), durably, invariants intact."""

from __future__ import annotations

import logging

import pytest

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.node_sync import LiveSequence as Live
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import recover
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal
from kvfleet.core.errors import InvalidArgument
from kvfleet.core.tenants import Tenant

BS, BPB = 16, 1 << 18  # four blocks per MiB
H = [bytes([i] * 16) for i in range(1, 9)]


def _charged(table: PageTable, node: str = "n0") -> dict[str, int]:
    return {s.tenant: s.blocks_charged for s in table.tenant_stats(node) if s.blocks_charged}


def test_an_unknown_node_is_registered_and_its_sequences_adopted() -> None:
    table = PageTable()
    result = table.sync_node("n0", 16, BS, BPB, [Live("a", "t", (3, 4), 20), Live("b", "u", (3, 9), 32)])
    assert result.registered and result.adopted == ["a", "b"] and not (result.released or result.refused)
    assert table.sequence("a").block_ids == [3, 4] and table.sequence("b").num_tokens == 32
    assert _charged(table) == {"t": 2, "u": 1}  # block 3 is shared: charged once, to who brought it
    assert table.node_stats("n0").num_used == 3
    table.check()
    # block_service's view now holds: new allocations avoid the adopted blocks
    alloc = table.allocate("n0", "c", "t", [], 4 * BS)
    assert isinstance(alloc, Allocation) and not set(alloc.block_ids) & {3, 4, 9}
    table.check()


def test_reconciliation_releases_what_the_node_no_longer_holds(caplog) -> None:
    table = PageTable()
    table.register_node("n0", 16, BS, BPB)
    table.register_node("n1", 16, BS, BPB)
    a, b, c = (table.allocate(n, s, "t", [], 20) for n, s in (("n0", "a"), ("n0", "b"), ("n1", "c")))
    with caplog.at_level(logging.INFO, logger="kvfleet.block_service.page_table"):
        result = table.sync_node("n0", 16, BS, BPB, [Live("a", "t", a.block_ids, 20)])
    assert not result.registered and result.released == ["b"] and not result.adopted and not result.updated
    assert "sync of node n0: released 1 sequences the node no longer holds" in caplog.text
    assert table.node_stats("n0").counters.reconciled_releases == 1
    assert table.node_stats("n0").num_sequences == 1 and table.sequence("c").node_id == "n1"
    table.check()


def test_a_known_sequence_takes_the_nodes_table_and_keeps_its_committed_blocks() -> None:
    table = PageTable()
    table.register_node("n0", 16, BS, BPB)
    a = table.allocate("n0", "a", "t", [], 32)
    table.commit([("a", 0, H[0]), ("a", 1, H[1])])
    # the node grew "a" by a block block_service never heard of (a lost top-up)
    result = table.sync_node("n0", 16, BS, BPB, [Live("a", "t", (*a.block_ids, 7), 40)])
    assert result.updated == ["a"] and not result.adopted
    assert table.sequence("a").block_ids == [*a.block_ids, 7] and table.sequence("a").num_committed == 2
    assert table.match_prefix(H[:2]) == {"n0": 2}
    # and shrank it back: block 7 is given back
    table.sync_node("n0", 16, BS, BPB, [Live("a", "t", a.block_ids, 32)])
    assert table.node_stats("n0").num_used == 2
    table.check()


def test_an_adopted_cached_block_loses_its_hash() -> None:
    """block_service cannot know what the node wrote in a block it thought cached."""
    table = PageTable()
    table.register_node("n0", 16, BS, BPB)
    a = table.allocate("n0", "a", "t", [], 16)
    table.commit([("a", 0, H[0])])
    table.release(["a"])
    assert table.match_prefix([H[0]]) == {"n0": 1}
    table.sync_node("n0", 16, BS, BPB, [Live("x", "t", a.block_ids, 5)])
    assert table.match_prefix([H[0]]) == {"n0": 0}
    table.check()


def test_adoption_is_never_refused_for_quota_and_grants_nothing_new_above_it() -> None:
    table = PageTable()
    table.configure_tenants([Tenant("small", quota_mib=0.5)])  # two blocks
    result = table.sync_node("n0", 16, BS, BPB, [Live("a", "small", (0, 1, 2, 3), 64)])
    assert result.adopted == ["a"] and _charged(table) == {"small": 4}
    table.check()
    refusal = table.allocate("n0", "b", "small", [], 1)
    assert isinstance(refusal, Refusal) and refusal.reason == "quota"
    table.release(["a"])
    assert isinstance(table.allocate("n0", "b", "small", [], 2 * BS), Allocation)
    table.check()


def test_a_new_shape_drops_the_old_pool() -> None:
    table = PageTable()
    table.register_node("n0", 16, BS, BPB)
    table.allocate("n0", "old", "t", [], 20)
    result = table.sync_node("n0", 32, 32, BPB, [Live("a", "t", (31,), 20)])
    assert result.registered and result.released == ["old"] and result.adopted == ["a"]
    assert table.node_stats("n0").num_blocks == 32 and table.sequence("a").block_ids == [31]
    table.check()


def test_what_cannot_be_true_is_refused_and_changes_nothing_of_it() -> None:
    table = PageTable()
    table.register_node("n0", 16, BS, BPB)
    table.register_node("n1", 16, BS, BPB)
    kept = table.allocate("n0", "kept", "t", [], 20)
    table.allocate("n1", "elsewhere", "t", [], 20)
    result = table.sync_node("n0", 16, BS, BPB, [
        Live("kept", "t", (1,), 20),          # two blocks' worth of tokens in one
        Live("far", "t", (16,), 5),           # outside the pool
        Live("twice", "t", (5, 5), 20),       # a block twice in one table
        Live("elsewhere", "t", (6,), 5),      # live on another node
        Live("", "t", (7,), 5),               # no id
        Live("neg", "t", (), -1),             # no count
        Live("ok", "t", (8,), 5),
        Live("ok", "t", (9,), 5),             # listed twice
    ])
    assert [s for s, _ in result.refused] == ["kept", "far", "twice", "elsewhere", "", "neg", "ok"]
    why = dict(result.refused)
    assert "cannot hold 20 tokens" in why["kept"] and "outside the pool" in why["far"]
    assert "twice in its table" in why["twice"] and "live on node 'n1'" in why["elsewhere"]
    assert "listed twice" in why["ok"] and "num_tokens" in why["neg"]
    assert result.adopted == ["ok"] and not result.released  # "kept": the node holds it, kept as it was
    assert table.sequence("kept").block_ids == kept.block_ids and table.sequence("elsewhere").node_id == "n1"
    table.check()


def test_bad_shapes_and_ids_are_errors() -> None:
    table = PageTable()
    with pytest.raises(InvalidArgument, match="block_size"):
        table.sync_node("n0", 16, 24, BPB, [])
    with pytest.raises(InvalidArgument, match="node_id"):
        table.sync_node("", 16, BS, BPB, [])
    assert table.node_ids() == []


def test_durable_and_only_logged_when_something_changed(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("n0", 16, BS, BPB)
    store.allocate_many([AllocateRequest("n0", s, "t", [], 20) for s in ("a", "b")])
    store.commit([("a", 0, H[0])])
    listed = [Live("a", "t", store.table.sequence("a").block_ids, 20), Live("new", "u", (9, 10), 17),
              Live("bad", "u", (99,), 5)]
    result = store.sync_node("n0", 16, BS, BPB, listed)
    assert result.released == ["b"] and result.adopted == ["new"] and len(result.refused) == 1
    lsn = store.lsn
    again = store.sync_node("n0", 16, BS, BPB, listed[:2])  # the periodic one, in agreement
    assert not again.changed and store.lsn == lsn
    store.sync()
    replayed, report = recover(str(tmp_path))
    assert report.stop_reason is None and replayed.to_dict() == store.table.to_dict()
    store.close()
    reopened, _ = DurablePageTable.open(str(tmp_path), fsync=False)  # and through a snapshot
    assert reopened.table.to_dict() == store.table.to_dict()
    reopened.table.check()
    reopened.close()
