"""Pins and their budget, through the durable page table: refusals with their line, a re-pin that
refreshes without charging, a lowered budget that keeps the pins made under the old one, expiry
that hands the blocks back to the policy, and a log and a snapshot that rebuild exactly the live
table's pins and evict the same blocks."""

from __future__ import annotations

import pytest

from kvfleet.block_service import wal_records as rec
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.pins import MAX_TTL_S, check_ttl
from kvfleet.block_service.recovery import recover
from kvfleet.block_service.snapshot import decode_snapshot, encode_snapshot
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvfleet.core.tenants import Tenant
from tests.block_service.test_page_table_stateful import family_hash

BPB = 1 << 18  # four blocks per MiB
BS = 16


def _store(tmp_path, policy: str = "lru") -> DurablePageTable:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False, eviction=policy)
    store.register_node("n0", 8, BS, BPB)
    store.configure_tenants([Tenant("a", pinned_mib=1), Tenant("b")])
    return store


def _cache(store: DurablePageTable, seq_id: str, family: int, n: int, tenant: str = "a") -> list[bytes]:
    """A finished prompt of ``n`` full blocks: committed, released, cached."""
    hashes = [family_hash(family, i) for i in range(n)]
    assert isinstance(store.allocate_many([AllocateRequest("n0", seq_id, tenant, hashes, n * BS)])[0], Allocation)
    store.commit([(seq_id, i, h) for i, h in enumerate(hashes)])
    store.release([seq_id])
    return hashes


def _flood(store: DurablePageTable, seq_id: str) -> None:
    """Tenant b takes every block it may, then gives them back (fresh: no prefix)."""
    n = store.table.num_available("n0", "b")
    assert isinstance(store.allocate_many([AllocateRequest("n0", seq_id, "b", [], n * BS)])[0], Allocation)
    store.release([seq_id])


def test_past_the_budget_the_whole_pin_is_refused_with_one_line(tmp_path) -> None:
    store = _store(tmp_path)
    first = store.pin_prefix("n0", "a", [family_hash(0, i) for i in range(3)], 100)
    assert (first.num_new, first.tenant_pinned, first.allowed) == (3, 3, 4)
    before, lsn = store.table.to_dict(), store.lsn
    with pytest.raises(ResourceExhausted) as err:
        store.pin_prefix("n0", "a", [family_hash(1, i) for i in range(2)], 100)
    assert str(err.value) == "tenant 'a' may pin 4 blocks (pinned_mib 1) on node 'n0'; 3 pinned, this pin needs 2 more"
    with pytest.raises(FailedPrecondition, match="tenant 'b' may not pin: it has pinned_mib 0"):
        store.pin_prefix("n0", "b", [family_hash(1, 0)], 100)
    with pytest.raises(FailedPrecondition, match="tenant 'zed' may not pin: it is not in the tenants file"):
        store.pin_prefix("n0", "zed", [family_hash(1, 0)], 100)
    with pytest.raises(NotFound, match="unknown node 'nX'"):
        store.pin_prefix("nX", "a", [family_hash(1, 0)], 100)
    with pytest.raises(InvalidArgument, match="at least one block hash"):
        store.pin_prefix("n0", "a", [], 100)
    assert store.table.to_dict() == before and store.lsn == lsn
    assert store.pins_refused == {("a", "budget"): 1, ("b", "no_budget"): 1, ("zed", "no_budget"): 1}


def test_a_re_pin_refreshes_without_charging_even_over_a_lowered_budget(tmp_path) -> None:
    store = _store(tmp_path)
    hashes = [family_hash(0, i) for i in range(3)]
    store.pin_prefix("n0", "a", hashes, 100)
    again = store.pin_prefix("n0", "a", hashes[:2], 500)
    assert (again.num_new, again.tenant_pinned) == (0, 3)
    [pins] = store.table.pins.summary()
    assert (pins.pinned, pins.earliest) == (3, 100)
    store.configure_tenants([Tenant("a", pinned_mib=0.25)])  # a reload lowers the budget to one block
    [pins] = store.table.pins.summary()
    assert (pins.pinned, pins.allowed) == (3, 1), "a reload dropped pins"
    assert store.pin_prefix("n0", "a", hashes, 900).tenant_pinned == 3  # a refresh: nothing new
    with pytest.raises(ResourceExhausted, match="may pin 1 blocks .* 3 pinned, this pin needs 1 more"):
        store.pin_prefix("n0", "a", [family_hash(5, 0)], 900)


@pytest.mark.parametrize("policy", ["lru", "value", "fair", "fair+value"])
def test_a_pinned_prompt_survives_a_flood_until_its_pin_expires(tmp_path, policy: str) -> None:
    store = _store(tmp_path, policy)
    kept = _cache(store, "s1", 0, 3)
    lost = _cache(store, "s2", 1, 3)
    store.pin_prefix("n0", "a", kept, 100)
    assert store.table.num_available("n0") == 8 - 3
    _flood(store, "f1")
    assert store.table.match_prefix(kept) == {"n0": 3}
    assert store.table.match_prefix(lost) == {"n0": 0}
    assert store.expire_pins(99) == 0 and store.expire_pins(100) == 3
    assert not store.table.pins.summary() and store.table.num_available("n0") == 8
    _flood(store, "f2")
    assert store.table.match_prefix(kept) == {"n0": 0}, "an expired pin still held its blocks"
    store.table.check()


def test_a_pin_made_before_the_prompt_holds_its_blocks_once_cached(tmp_path) -> None:
    store = _store(tmp_path)
    hashes = [family_hash(0, i) for i in range(2)]
    store.pin_prefix("n0", "a", hashes, 100)  # charged though nothing is there yet
    [pins] = store.table.pins.summary()
    assert (pins.pinned, pins.cached) == (2, 0)
    _cache(store, "s1", 0, 2)
    _flood(store, "f1")
    assert store.table.match_prefix(hashes) == {"n0": 2}


def test_the_log_and_a_snapshot_rebuild_the_pins_and_evict_alike(tmp_path) -> None:
    store = _store(tmp_path, "fair+value")
    kept = _cache(store, "s1", 0, 3)
    _cache(store, "s2", 1, 2, tenant="b")
    store.pin_prefix("n0", "a", kept, 100)
    store.pin_prefix("n0", "a", [family_hash(2, 0)], 50)
    store.expire_pins(60)
    _cache(store, "s3", 3, 2, tenant="b")
    store.sync()
    restored = PageTable.from_dict(decode_snapshot(encode_snapshot(1, store.table.to_dict()))[1])
    replayed, report = recover(str(tmp_path), eviction="fair+value")
    assert report.stop_reason is None
    assert restored.to_dict() == replayed.to_dict() == store.table.to_dict()
    for t in (restored, replayed, store.table):
        t.check()
    victims = [t.next_victims("n0", 8) for t in (restored, replayed, store.table)]
    assert victims[0] == victims[1] == victims[2] and len(victims[0]) == store.table.node_stats("n0").num_cached - 3
    store.close()


def test_pin_records_round_trip() -> None:
    hashes = [family_hash(0, i) for i in range(3)]
    assert rec.decode(rec.encode_pin("n0", "a", hashes, 1 << 40)) == (rec.PIN, ("n0", "a", hashes, 1 << 40))
    assert rec.decode(rec.encode_unpin("n0", hashes[:1])) == (rec.UNPIN, ("n0", hashes[:1]))
    with pytest.raises(ValueError, match="stray bytes"):
        rec.decode(rec.encode_unpin("n0", hashes[:1]) + b"x")


def test_a_ttl_is_one_second_to_seven_days() -> None:
    assert check_ttl(1) == 1 and check_ttl(MAX_TTL_S) == MAX_TTL_S
    for bad in (0, MAX_TTL_S + 1, -1, True):
        with pytest.raises(InvalidArgument, match="ttl must be 1..604800 seconds"):
            check_ttl(bad)


def test_kvfleet_blocks_shows_pins_per_tenant_and_node() -> None:
    from kvfleet.block_service.blocks_report import BlocksReport, NodeBlocks, render, to_json
    from kvfleet.block_service.pins import TenantPins

    table = PageTable()
    table.register_node("n0", 8, BS, BPB)
    report = BlocksReport([NodeBlocks(table.node_stats("n0"))], [], 0, [TenantPins("a", "n0", 3, 1, 2, 86400)])
    text = render(report)
    assert "pins (blocks; a lowered budget keeps older pins until they expire):" in text
    assert [line.split() for line in text.splitlines()[-2:]] == [
        ["tenant", "node", "pinned", "budget", "on", "node", "earliest", "expiry"],
        ["a", "n0", "3", "1", "2", "1970-01-02", "00:00:00", "UTC"]]
    assert to_json(report)["pins"] == [{"tenant": "a", "node_id": "n0", "pinned": 3, "allowed": 1, "cached": 2,
                                        "earliest": 86400}]


def test_pins_and_refusals_are_metrics(tmp_path) -> None:
    from kvfleet.block_service import metrics
    from kvfleet.core.metric_families import registry_of

    store = _store(tmp_path)
    store.pin_prefix("n0", "a", [family_hash(0, i) for i in range(3)], 100)
    for tenant in ("a", "b"):
        with pytest.raises((ResourceExhausted, FailedPrecondition)):
            store.pin_prefix("n0", tenant, [family_hash(1, i) for i in range(2)], 100)
    r = registry_of(metrics.families(metrics.sample(store)))
    assert r.get_sample_value("kvfleet:pinned_blocks", {"tenant": "a", "node": "n0"}) == 3
    assert r.get_sample_value("kvfleet:pins_refused_total", {"tenant": "a", "reason": "budget"}) == 1
    assert r.get_sample_value("kvfleet:pins_refused_total", {"tenant": "b", "reason": "no_budget"}) == 1
