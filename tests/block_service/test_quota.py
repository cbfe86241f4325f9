"""Tenant quotas and isolation: MiB to blocks per node, shared prefixes charged once, reserved shares."""

from __future__ import annotations

import pytest

from block_service.page_table import PageTable
from block_service.tenants import MIB, TenantConfig, tenant_configs
from kvfleet.allocator import Allocation, Refusal
from kvfleet.block_hash import block_hashes
from kvfleet.tenants import parse_tenants

BS = 16
BPB = MIB // 4  # four blocks per MiB


@pytest.fixture
def table() -> PageTable:
    t = PageTable()
    t.register_node("n0", 16, BS, BPB)
    t.register_node("n1", 16, BS, BPB // 2)
    t.configure_tenants([TenantConfig("a", quota_mib=1), TenantConfig("b", quota_mib=2, reserved_mib=1)])
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
    table.configure_tenants([TenantConfig("a", quota_mib=0.5)])
    table.check()  # over quota by configuration only
    assert table.allocate("n0", "s2", "a", [], 1).reason == "quota"
    table.release(["s1"])
    table.check()


def test_tenants_file_entries_become_configs_without_keys() -> None:
    doc = {"tenants": [
        {"name": "acme", "api_key": "k1", "quota_mib": 512, "reserved_mib": 128, "paid_level": 2, "max_concurrent": 8},
        {"name": "free", "api_key": "k2", "quota_mib": 64, "paid_level": 0, "max_concurrent": 2},
    ]}
    acme, free = tenant_configs(parse_tenants(doc))
    assert acme == TenantConfig("acme", 512, 128, 2, 8) and free == TenantConfig("free", 64, 0, 0, 2)
    assert acme.api_key == free.api_key == ""
