"""block_service's metrics are its page table's own figures: charged blocks, quotas, refusals, pools."""

from __future__ import annotations

import pytest

from kvfleet.block_service import metrics
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import Allocation, Refusal
from kvfleet.core.metric_families import registry_of
from kvfleet.core.tenants import MIB, Tenant

BS = 16
BPB = MIB // 4  # four blocks per MiB


def _registry(sample):
    return registry_of(metrics.families(sample))


def _table() -> PageTable:
    t = PageTable()
    t.register_node("n0", 16, BS, BPB)
    t.configure_tenants([Tenant("a", quota_mib=1), Tenant("b")])
    assert isinstance(t.allocate("n0", "s1", "a", [], 3 * BS), Allocation)
    assert isinstance(t.allocate("n0", "s2", "b", [], 5 * BS + 1), Allocation)
    assert isinstance(t.allocate("n0", "s3", "a", [], 2 * BS), Refusal)  # 3 charged of 4
    return t


def test_charged_quota_and_refusals_per_tenant_match_the_stats():
    table = _table()
    r = _registry(metrics.sample(DurablePageTable(table, None)))
    for t in table.tenant_stats("n0"):
        labels = {"tenant": t.tenant, "node": "n0"}
        assert r.get_sample_value("kvfleet:tenant_blocks_charged", labels) == t.blocks_charged
        assert r.get_sample_value("kvfleet:tenant_blocks_quota", labels) == t.blocks_allowed  # None: absent
        assert r.get_sample_value("kvfleet:block_refusals_total", {**labels, "reason": "quota"}) \
            == t.counters.refusals_quota
    assert r.get_sample_value("kvfleet:tenant_blocks_charged", {"tenant": "a", "node": "n0"}) == 3
    assert r.get_sample_value("kvfleet:tenant_blocks_charged", {"tenant": "b", "node": "n0"}) == 6
    assert r.get_sample_value("kvfleet:block_refusals_total", {"tenant": "a", "node": "n0", "reason": "quota"}) == 1


def test_pool_by_state_sums_to_its_size_and_usage_is_the_used_share():
    table = _table()
    r = _registry(metrics.sample(DurablePageTable(table, None)))
    states = {s: r.get_sample_value("kvfleet:pool_blocks", {"node": "n0", "state": s}) for s in ("used", "cached", "free")}
    assert states["used"] == 9 and sum(states.values()) == 16
    assert r.get_sample_value("kvfleet:pool_usage_perc", {"node": "n0"}) == 9 / 16
    assert r.get_sample_value("kvfleet:num_sequences", {"node": "n0"}) == 2
    # 5 * 16 + 1 tokens in 6 blocks: 15 slots of the last one unused, of 9 blocks' 144
    assert r.get_sample_value("kvfleet:pool_fragmentation_perc", {"node": "n0"}) == pytest.approx(15 / 144)


def test_log_and_snapshot_figures(tmp_path):
    store, _ = DurablePageTable.open(str(tmp_path))
    store.register_node("n0", 16, BS, BPB)
    store.sync()
    sample = metrics.sample(store, now=store.last_snapshot + 7.5)
    r = _registry(sample)
    assert r.get_sample_value("kvfleet:wal_records_total") == store.durable_lsn == 1
    assert r.get_sample_value("kvfleet:wal_bytes") == store.log_bytes > 0
    assert r.get_sample_value("kvfleet:snapshot_age_seconds") == 7.5
    store.close()


def test_without_durability_there_is_no_snapshot_age():
    sample = metrics.sample(DurablePageTable(PageTable(), None))
    assert _registry(sample).get_sample_value("kvfleet:snapshot_age_seconds") is None


def test_group_commits_are_observed_when_a_hook_is_set(tmp_path):
    m = metrics.BlockServiceMetrics()
    store, _ = DurablePageTable.open(str(tmp_path))
    store.on_write = m.wal_fsync.observe
    store.register_node("n0", 16, BS, BPB)
    store.sync()
    store.release([])
    store.configure_tenants([Tenant("a")])
    store.sync()
    assert m.registry.get_sample_value("kvfleet:wal_fsync_seconds_count") == 2
    store.close()


def test_lower_tier_blocks_per_node_and_tier_and_refusals_per_tenant():
    from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TierChange

    table = _table()
    table.configure_tenants([Tenant("a", quota_mib=1, lower_tier_quota_mib=0.5), Tenant("b")])  # a: 2 blocks
    moves = [TierChange(bytes([i]) * 16, "a" if i < 3 else "b", TIER_HOST if i % 2 else TIER_DISK)
             for i in range(5)]
    assert len(table.record_tiers("n0", moves).refused) == 1
    r = _registry(metrics.sample(DurablePageTable(table, None)))
    assert r.get_sample_value("kvfleet:lower_tier_blocks", {"node": "n0", "tier": "host"}) == 2
    assert r.get_sample_value("kvfleet:lower_tier_blocks", {"node": "n0", "tier": "disk"}) == 2
    a, b = {"tenant": "a", "node": "n0"}, {"tenant": "b", "node": "n0"}
    assert r.get_sample_value("kvfleet:tenant_lower_tier_blocks", a) == 2
    assert r.get_sample_value("kvfleet:tenant_lower_tier_blocks", b) == 2
    assert r.get_sample_value("kvfleet:tenant_lower_tier_quota", a) == 2
    assert r.get_sample_value("kvfleet:tenant_lower_tier_quota", b) is None  # unlimited
    assert r.get_sample_value("kvfleet:block_refusals_total", {**a, "reason": "lower_tier"}) == 1
    assert r.get_sample_value("kvfleet:block_refusals_total", {**b, "reason": "lower_tier"}) == 0
