"""Per tenant, the cached blocks it holds on a node against its share of them: the pool's figures
(``cache_figures``) and block_service's gauges (``kvfleet:cached_blocks``, ``cache_share_blocks``)."""

from __future__ import annotations

from kvfleet.block_service import metrics
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import Allocation
from kvfleet.core.metric_families import registry_of
from kvfleet.core.tenants import MIB, Tenant

BS = 16
BPB = MIB // 4  # four blocks per MiB


def _hashes(tag: int, n: int) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def _cached_table() -> PageTable:
    """a caches 3 blocks, b caches 2 and still uses 1 more (not cached)."""
    table = PageTable("fair")
    table.register_node("n0", 16, BS, BPB)
    table.configure_tenants([Tenant("a", cache_share_mib=1), Tenant("b", reserved_mib=0.5, quota_mib=4)])
    for seq, tenant, hashes in (("s1", "a", _hashes(1, 3)), ("s2", "b", _hashes(2, 2)), ("s3", "b", _hashes(3, 1))):
        assert isinstance(table.allocate("n0", seq, tenant, hashes, len(hashes) * BS), Allocation)
        table.commit([(seq, i, h) for i, h in enumerate(hashes)])
    table.release(["s1", "s2"])
    return table


def test_cached_blocks_count_for_the_tenant_last_charged_and_add_up_to_the_pools():
    table = _cached_table()
    stats = {t.tenant: t.cached_blocks for t in table.tenant_stats("n0")}
    assert stats["a"] == 3 and stats["b"] == 2
    assert sum(stats.values()) == table.node_stats("n0").num_cached == 5


def test_a_block_hit_again_is_in_use_not_cached():
    table = _cached_table()
    assert isinstance(table.allocate("n0", "s4", "b", _hashes(1, 2), 2 * BS + 1), Allocation)
    assert {t.tenant: t.cached_blocks for t in table.tenant_stats("n0")}["a"] == 1


def test_the_gauges_carry_cached_blocks_and_shares_per_tenant():
    table = _cached_table()
    r = registry_of(metrics.families(metrics.sample(DurablePageTable(table, None))))
    a, b = {"tenant": "a", "node": "n0"}, {"tenant": "b", "node": "n0"}
    assert r.get_sample_value("kvfleet:cached_blocks", a) == 3
    assert r.get_sample_value("kvfleet:cached_blocks", b) == 2
    assert r.get_sample_value("kvfleet:cache_share_blocks", a) == 4  # cache_share_mib 1: four blocks
    assert r.get_sample_value("kvfleet:cache_share_blocks", b) == 2  # reserved_mib 0.5 is its share
    table.configure_tenants([Tenant("a")], replace_all=True)  # no share any more: the series goes
    r = registry_of(metrics.families(metrics.sample(DurablePageTable(table, None))))
    assert r.get_sample_value("kvfleet:cache_share_blocks", a) is None
    assert r.get_sample_value("kvfleet:cached_blocks", a) == 3  # a reload loses nothing cached


def test_an_empty_pool_has_nothing_cached():
    table = PageTable()
    table.register_node("n0", 8, BS, BPB)
    assert all(t.cached_blocks == 0 for t in table.tenant_stats("n0"))

