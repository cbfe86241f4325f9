"""Lower tiers through the real gRPC server: tier moves in ApplyMany with a bad one refused
alone and one past the tenant's cap refused back to the node, MatchPrefix's hot and lower-tier runs,
Stats' per-tier counts and per-tenant charges, a sync replacing a node's index, and a restart."""

from __future__ import annotations

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.recovery import recover
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TierChange
from kvfleet.core.block_hash import block_hashes
from kvfleet.core.tenants import MIB, Tenant
from tests.block_service.test_block_server import serve_and_run


def test_tier_moves_lookups_and_figures_through_the_server(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    hs = block_hashes(list(range(160)), 16, extra=b"a")

    async def body(client: BlockManagerClient) -> None:
        for n in ("n0", "n1"):
            await client.register_node(n, 8, 16, MIB)
        await client.configure_tenants([Tenant("a", quota_mib=4, lower_tier_quota_mib=2)])
        assert (await client.allocate("n0", "s", "a", hs, 16)).block_ids == [0]
        await client.commit([("s", 0, hs[0])])
        moves = [TierChange(hs[1], "a", TIER_HOST), TierChange(hs[5], "", TIER_HOST),  # no tenant: bad
                 TierChange(hs[2], "a", TIER_DISK), TierChange(hs[3], "a", TIER_HOST)]  # past the cap
        result = await client.apply([], [], [], node_id="n0", tiers=moves)
        assert [(e.kind, e.index, e.code) for e in result.errors] == [("tier", 1, "INVALID_ARGUMENT")]
        assert result.tier_refused == [hs[3]]
        assert await client.match_tiers(hs) == ({"n0": 1, "n1": 0}, {"n0": 2})
        assert await client.match_tiers(hs, ["n1"]) == ({"n1": 0}, {})
        assert await client.match_prefix(hs) == {"n0": 1, "n1": 0}
        report = await client.blocks(["n0"])
        assert [(t.tier, t.num_cached) for t in report.nodes[0].tiers] == [("device", 0), ("host", 1), ("disk", 1)]
        assert report.nodes[0].stats.lower_tier == {"host": 1, "disk": 1}
        (a,) = [t for t in report.tenants if t.tenant == "a"]
        assert (a.lower_tier_blocks, a.lower_tier_allowed, a.counters.refusals_lower_tier) == (2, 2, 1)
        # the node's own account replaces block_service's (a resync after a restart, a reconciliation)
        await client.sync_node("n1", 8, 16, MIB, [], [TierChange(hs[0], "a", TIER_HOST)])
        assert (await client.match_tiers(hs[:3]))[1] == {"n0": 2, "n1": 1}
        await client.sync_node("n1", 8, 16, MIB, [])  # without an index: left as it is
        assert (await client.match_tiers(hs[:3]))[1] == {"n0": 2, "n1": 1}

    serve_and_run(store, body)
    store.sync()
    table, _ = recover(str(tmp_path))
    assert table.match_tiers(hs) == store.table.match_tiers(hs)
    assert sorted(table.lower_tiers("n0"), key=lambda c: c.block_hash) == sorted(
        store.table.lower_tiers("n0"), key=lambda c: c.block_hash)
    assert [t.name for t in table.tenants() if t.lower_tier_quota_mib == 2] == ["a"]
    table.check()
    store.close()
