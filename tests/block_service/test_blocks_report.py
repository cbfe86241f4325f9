"""``kvfleet blocks``' figures from the pure page table: top holders by blocks with their tail waste,
their age a lower bound after a recovery (kept in memory only), and the report's two renderings."""

from __future__ import annotations

from pathlib import Path

from kvfleet.block_service.blocks_report import BlocksReport, NodeBlocks, render, to_json
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.stats import TierBlocks
from kvfleet.core.allocator import AllocateRequest


def _filled() -> PageTable:
    table = PageTable()
    table.register_node("n0", 32, 16, 1 << 16)
    for seq_id, tenant, tokens in [("s1", "a", 20), ("s2", "b", 64), ("s3", "a", 33), ("s4", "b", 33)]:
        table.allocate("n0", seq_id, tenant, [], tokens)
    return table


def test_top_holders_rank_by_blocks_then_id_with_their_tail_waste() -> None:
    holders = _filled().top_holders("n0", 3)
    assert [(h.seq_id, h.tenant, h.num_blocks, h.num_tokens, h.tail_waste_tokens) for h in holders] == [
        ("s2", "b", 4, 64, 0), ("s3", "a", 3, 33, 15), ("s4", "b", 3, 33, 15)]
    assert all(h.age_s >= 0 and not h.age_at_least for h in holders)
    assert _filled().top_holders("n0", 0) == []


def test_after_a_restart_the_ages_of_recovered_sequences_are_lower_bounds(tmp_path: Path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("n0", 32, 16, 1 << 16)
    store.snapshot()
    store.allocate_many([AllocateRequest("n0", "old", "a", [], 40)])  # replayed from the log
    store.sync()
    reopened, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    assert [h.age_at_least for h in reopened.table.top_holders("n0", 5)] == [True]
    reopened.table.allocate("n0", "fresh", "a", [], 16)
    assert {h.seq_id: h.age_at_least for h in reopened.table.top_holders("n0", 5)} == {"old": True, "fresh": False}


def test_the_report_renders_tiers_holders_waste_and_tenants() -> None:
    table = _filled()
    stats = table.node_stats("n0")
    node = NodeBlocks(stats, [TierBlocks(tier="device", num_used=stats.num_used, num_cached=0,
                                         num_free=stats.num_free)], table.top_holders("n0", 2))
    report = BlocksReport([node], table.tenant_stats("n0"), 4)
    data = to_json(report)
    assert data["nodes"][0]["waste_tokens"] == 12 + 0 + 15 + 15 == node.waste_tokens
    assert (data["nodes"][0]["used"], data["nodes"][0]["free"]) == (12, 20)
    assert {t["tenant"]: t["charged"] for t in data["tenants"]} == {"a": 5, "b": 7}
    text = render(report)
    assert "device  12    0       20" in text and "waste: 42 token slots" in text
    assert render(BlocksReport([], [])) == "no nodes registered"


def test_the_report_shows_lower_tiers_per_node_and_their_charge_per_tenant() -> None:
    from kvfleet.block_service.wire import tier_from_pb, tiers_to_pb
    from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TierChange
    from kvfleet.core.tenants import Tenant

    table = _filled()
    table.configure_tenants([Tenant("a", lower_tier_quota_mib=0.25)])  # 4 blocks of 64 KiB
    moves = [TierChange(bytes([i]) * 16, "a", TIER_HOST if i < 3 else TIER_DISK) for i in range(6)]
    assert len(table.record_tiers("n0", moves).refused) == 2
    stats = table.node_stats("n0")
    node = NodeBlocks(stats, [tier_from_pb(t) for t in tiers_to_pb(stats)])
    report = BlocksReport([node], table.tenant_stats("n0"))
    data = to_json(report)
    assert data["nodes"][0]["lower_tier"] == {"host": 3, "disk": 1}
    assert data["nodes"][0]["refusals_lower_tier"] == 2
    (a,) = [t for t in data["tenants"] if t["tenant"] == "a"]
    assert (a["lower_tier"], a["lower_tier_quota"], a["refusals_lower_tier"]) == (4, 4, 2)
    text = render(report)
    assert "host    0     3       0" in text and "disk    0     1       0" in text
    assert "lower tier  lower cap  refused lower" in text


def test_fetches_from_peers_under_way_show_as_transfers_in_flight() -> None:
    from kvfleet.block_service.wire import node_stats_from_pb, node_stats_to_pb
    from kvfleet.core.ids import FETCH_SEQ_PREFIX

    table = _filled()
    assert "transfers in flight" not in render(BlocksReport([NodeBlocks(table.node_stats("n0"))], []))
    table.allocate("n0", FETCH_SEQ_PREFIX + "1", "a", [], 5 * 16)
    table.allocate("n0", FETCH_SEQ_PREFIX + "2", "b", [], 2 * 16)
    stats = node_stats_from_pb(node_stats_to_pb(table.node_stats("n0")))  # as `kvfleet blocks` reads it
    assert (stats.transfers_in_flight, stats.transfer_blocks_in_flight) == (2, 7)
    report = BlocksReport([NodeBlocks(stats)], [])
    assert to_json(report)["nodes"][0]["transfers_in_flight"] == 2
    assert "transfers in flight: 2 fetches from peers holding 7 blocks" in render(report)
    table.release([FETCH_SEQ_PREFIX + "1"])
    assert table.node_stats("n0").transfers_in_flight == 1


def test_a_node_role_from_membership_labels_its_pool() -> None:
    table = _filled()
    report = BlocksReport([NodeBlocks(table.node_stats("n0"), role="prefill")], [])
    assert render(report).startswith("node n0 (prefill): 32 blocks of 16 tokens")
    assert to_json(report)["nodes"][0]["role"] == "prefill"
    assert to_json(BlocksReport([NodeBlocks(table.node_stats("n0"))], []))["nodes"][0]["role"] is None
