"""Tenant quotas and isolation: MiB to blocks per node, shared prefixes charged once, reserved shares."""

from __future__ import annotations

import json

import pytest

from kvfleet.block_service import wal_records
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import Allocation, Refusal
from kvfleet.core.block_hash import block_hashes
from kvfleet.core.errors import InvalidArgument
from kvfleet.core.tenants import MIB, Tenant, TenantsFileError, parse_tenants

BS = 16
BPB = MIB // 4  # four blocks per MiB


@pytest.fixture
def table() -> PageTable:
    t = PageTable()
    t.register_node("n0", 16, BS, BPB)
    t.register_node("n1", 16, BS, BPB // 2)
    t.configure_tenants([Tenant("a", quota_mib=1), Tenant("b", quota_mib=2, reserved_mib=1)])
    return t


def test_quota_in_blocks_per_node(table: PageTable) -> None:
    allowed = {(s.node_id, s.tenant): s.blocks_allowed for n in ("n0", "n1") for s in table.tenant_stats(n)}
    assert allowed[("n0", "a")] == 4 and allowed[("n1", "a")] == 8 and allowed[("n0", "b")] == 8


def test_refusal_beyond_quota_names_tenant_asked_charged_allowed(table: PageTable) -> None:
    assert isinstance(table.allocate("n0", "s1", "a", [], 3 * BS), Allocation)
    before = table.to_dict()
    r = table.allocate("n0", "s2", "a", [], 2 * BS)
    assert r == Refusal("quota", "n0", "a", 2, 3, 4)
    assert "tenant 'a'" in r.message() and "asked 2 blocks, 3 charged of 4 allowed" in r.message()
    assert table.to_dict() == before
    assert isinstance(table.extend([("s1", 4 * BS)])[0], list)
    assert isinstance(table.extend([("s1", 5 * BS)])[0], Refusal)
    table.check()


def test_shared_prefix_charged_once_to_creator(table: PageTable) -> None:
    hs = block_hashes(list(range(2 * BS)), BS, seed=b"q")
    table.allocate("n0", "s1", "b", hs, 2 * BS)
    table.commit([("s1", i, h) for i, h in enumerate(hs)])
    alloc = table.allocate("n0", "s2", "a", hs, 2 * BS + 1)
    assert alloc.num_cached_blocks == 2
    charged = {s.tenant: s.blocks_charged for s in table.tenant_stats("n0")}
    assert charged == {"a": 1, "b": 2}
    table.release(["s1"])  # b created the blocks; the charge stays while a still holds them
    charged = {s.tenant: s.blocks_charged for s in table.tenant_stats("n0")}
    assert charged == {"a": 1, "b": 2}
    table.release(["s2"])
    assert all(s.blocks_charged == 0 for s in table.tenant_stats("n0"))
    table.check()


def test_reviving_cached_blocks_charges_the_reviver(table: PageTable) -> None:
    hs = block_hashes(list(range(3 * BS)), BS, seed=b"q")
    table.allocate("n0", "s1", "b", hs, 3 * BS)
    table.commit([("s1", i, h) for i, h in enumerate(hs)])
    table.release(["s1"])
    table.allocate("n0", "s2", "a", [], 2 * BS)
    r = table.allocate("n0", "s3", "a", hs, 3 * BS)  # 3 revived blocks would exceed a's 4
    assert isinstance(r, Refusal) and r.reason == "quota" and r.blocks_asked == 3
    table.check()


def test_reserved_share_is_kept_from_others(table: PageTable) -> None:
    # b reserves 4 blocks of n0's 16; an unlimited tenant may take only 12
    r = table.allocate("n0", "s1", "free-rider", [], 13 * BS)
    assert isinstance(r, Refusal) and r.reason == "pool"
    assert isinstance(table.allocate("n0", "s1", "free-rider", [], 12 * BS), Allocation)
    assert isinstance(table.allocate("n0", "s2", "b", [], 4 * BS), Allocation)
    table.check()


def test_live_blocks_of_another_tenant_are_never_evicted(table: PageTable) -> None:
    table.allocate("n0", "s1", "x", [], 12 * BS)
    assert table.allocate("n0", "s2", "a", [], 1).reason == "pool"
    assert table.sequence("s1").block_ids == list(range(12))


def test_quota_cut_keeps_live_blocks_and_grants_nothing_new(table: PageTable) -> None:
    table.allocate("n0", "s1", "a", [], 4 * BS)
    table.configure_tenants([Tenant("a", quota_mib=0.5)])
    table.check()  # over quota by configuration only
    assert table.allocate("n0", "s2", "a", [], 1).reason == "quota"
    table.release(["s1"])
    table.check()


def test_tenants_file_entries_become_configs_without_keys() -> None:
    doc = {"tenants": [
        {"name": "acme", "api_key": "k1", "quota_mib": 512, "reserved_mib": 128, "paid_level": 2, "max_concurrent": 8},
        {"name": "free", "api_key": "k2", "quota_mib": 64, "paid_level": 0, "max_concurrent": 2},
    ]}
    table = PageTable()
    table.configure_tenants(parse_tenants(doc))
    acme, free = table.tenants()
    assert acme == Tenant("acme", quota_mib=512, reserved_mib=128, paid_level=2, max_concurrent=8)
    assert free == Tenant("free", quota_mib=64, paid_level=0, max_concurrent=2)
    assert acme.api_key == free.api_key == ""
    assert "k1" not in json.dumps(table.to_dict())


def test_keys_never_reach_the_log_or_snapshots(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.configure_tenants([Tenant("acme", api_key="sk-secret", quota_mib=1)])
    store.close()
    assert all(b"sk-secret" not in p.read_bytes() for p in tmp_path.iterdir())


def test_old_tenant_records_still_load() -> None:
    """Snapshots and log records written before the one tenant type hold ``TenantConfig``'s dict."""
    old = {"name": "a", "quota_mib": 1.0, "reserved_mib": 0.5, "paid_level": 1, "max_concurrent": 2, "api_key": ""}
    table = PageTable.from_dict({"tenants": [old], "nodes": {}, "sequences": []})
    assert table.tenants() == [Tenant("a", quota_mib=1.0, reserved_mib=0.5, paid_level=1, max_concurrent=2)]
    record = bytes([wal_records.TENANTS, 1]) + json.dumps([old, {**old, "name": "b", "quota_mib": None}]).encode()
    wal_records.apply(table, record)
    assert [t.quota_mib for t in table.tenants()] == [1.0, None]


def test_one_validation_for_the_file_and_the_service() -> None:
    for bad in (dict(quota_mib=0), dict(quota_mib=float("nan")), dict(quota_mib=1, reserved_mib=2),
                dict(paid_level=-1), dict(max_concurrent=-1), dict(api_key="a b")):
        with pytest.raises(InvalidArgument):
            Tenant("t", **bad)
        entry = {"name": "t", "api_key": "k", "quota_mib": 1, "paid_level": 0, "max_concurrent": 0, **bad}
        with pytest.raises(TenantsFileError):
            parse_tenants({"tenants": [entry]})
