"""The nodes' warm-up is not a tenant: ``kvfleet blocks`` shows its row only while it holds blocks."""

from __future__ import annotations

from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import Allocation
from kvfleet.core.tenants import MIB, WARMUP_TENANT, Tenant

BS = 16


def _rows(table: PageTable) -> dict[str, int]:
    return {t.tenant: t.blocks_charged for t in table.tenant_stats("n0")}


def test_the_warmup_row_shows_while_it_holds_blocks_and_goes_with_them():
    table = PageTable()
    table.register_node("n0", 8, BS, MIB)
    table.configure_tenants([Tenant("a", quota_mib=4)])
    assert isinstance(table.allocate("n0", "w1", WARMUP_TENANT, [], 2 * BS), Allocation)
    assert _rows(table) == {"a": 0, WARMUP_TENANT: 2}  # its blocks are in the pool's figures
    table.release(["w1"])
    assert _rows(table) == {"a": 0}  # its lookups and counters alone do not make it a tenant
    assert isinstance(table.allocate("n0", "s1", "b", [], BS), Allocation)
    table.release(["s1"])
    assert "b" in _rows(table)  # an unconfigured tenant that came by still shows
