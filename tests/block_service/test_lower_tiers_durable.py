"""Lower-tier records in the write-ahead log and snapshots: a restart of block_service
recovers which blocks each node holds in host memory or on disk, and each tenant's charge against its
lower-tier cap; bookkeeping applies tier moves item by item."""

from __future__ import annotations

import hashlib

import pytest

from kvfleet.block_service import wal_records as rec
from kvfleet.block_service.bookkeeping import TIER, TierBatch
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.recovery import recover
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, TierChange
from kvfleet.core.errors import InvalidArgument
from kvfleet.core.tenants import MIB, Tenant


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def by_hash(changes):
    return sorted(changes, key=lambda c: c.block_hash)


def test_a_tiers_record_is_compact_and_decodes_to_its_changes():
    changes = [TierChange(h(i), "ab"[i % 2], (TIER_HOST, TIER_DISK, TIER_NONE)[i % 3]) for i in range(100)]
    payload = rec.encode_tiers("node-1", changes)
    assert len(payload) <= 20 * len(changes) + 32  # a hash and a u32 per move, the names once
    assert rec.decode(payload) == (rec.TIERS, ("node-1", changes))
    assert rec.decode(rec.encode_tiers("n", changes[:2], replace=True)) == (rec.REPLACE_TIERS, ("n", changes[:2]))


def test_replay_and_snapshots_recover_the_tiers(tmp_path):
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.configure_tenants([Tenant("a", lower_tier_quota_mib=3)])
    for n in ("n0", "n1"):
        store.register_node(n, 8, 16, MIB)
    out = store.record_tiers("n0", [TierChange(h(i), "a", TIER_HOST) for i in range(4)])
    assert out.refused == [h(3)]
    store.record_tiers("n0", [TierChange(h(0), "a", TIER_DISK), TierChange(h(1), "a", TIER_NONE)])
    store.record_tiers("n1", [TierChange(h(i), "b", TIER_HOST) for i in range(5)])
    store.sync()
    expected = {n: by_hash(store.table.lower_tiers(n)) for n in ("n0", "n1")}
    assert expected["n0"] == by_hash([TierChange(h(0), "a", TIER_DISK), TierChange(h(2), "a", TIER_HOST)])

    table, report = recover(str(tmp_path))     # log replay, no snapshot but the empty first one
    assert report.records_applied >= 5
    assert {n: by_hash(table.lower_tiers(n)) for n in ("n0", "n1")} == expected
    assert [t.lower_tier_blocks for t in table.tenant_stats("n0") if t.tenant == "a"] == [2]
    table.check()

    store.snapshot()                            # now from a snapshot, then one more record
    store.sync_node("n1", 8, 16, MIB, [], [TierChange(h(9), "b", TIER_DISK)])
    store.deregister_node("n0")
    store.sync()
    table, _ = recover(str(tmp_path))
    assert table.lower_tiers("n1") == [TierChange(h(9), "b", TIER_DISK)]
    assert table.match_tiers([h(9)]) == ({"n1": 0}, {"n1": 1})
    table.check()
    store.close()
    table, report = recover(str(tmp_path))      # the clean shutdown's snapshot alone
    assert report.records_applied == 0 and table.lower_tiers("n1") == [TierChange(h(9), "b", TIER_DISK)]


def test_a_sync_that_agrees_logs_nothing_and_bad_tiers_change_nothing(tmp_path):
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("n", 8, 16, MIB)
    held = [TierChange(h(1), "a", TIER_HOST)]
    store.sync_node("n", 8, 16, MIB, [], held)
    lsn = store.lsn
    store.sync_node("n", 8, 16, MIB, [], held)
    assert store.lsn == lsn
    with pytest.raises(InvalidArgument):
        store.sync_node("n", 16, 16, MIB, [], [TierChange(h(2), "a", TIER_NONE)])
    assert store.lsn == lsn and store.table.lower_tiers("n") == held  # the new shape was not taken either


def test_bookkeeping_refuses_a_bad_tier_move_alone(tmp_path):
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.configure_tenants([Tenant("a", lower_tier_quota_mib=1)])
    store.register_node("n", 8, 16, MIB)
    moves = [TierChange(h(0), "a", TIER_HOST), TierChange(h(1), "a", "tape"), TierChange(h(2), "a", TIER_HOST),
             TierChange(h(3), "b", TIER_DISK)]
    result = store.apply([], [], [], tiers=TierBatch("n", moves))
    assert [(e.kind, e.index, e.code) for e in result.errors] == [(TIER, 1, "INVALID_ARGUMENT")]
    assert result.tier_refused == [h(2)]
    assert by_hash(store.table.lower_tiers("n")) == by_hash([moves[0], moves[3]])
    unknown = store.apply([], [], [], tiers=TierBatch("gone", moves[:1]))
    assert [(e.kind, e.code) for e in unknown.errors] == [(TIER, "NOT_FOUND")]
    store.sync()
    table, _ = recover(str(tmp_path))
    assert by_hash(table.lower_tiers("n")) == by_hash([moves[0], moves[3]])
