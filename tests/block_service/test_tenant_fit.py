"""A tenants file against the nodes' pools: a pin budget past a whole pool is refused; shares,
reservations and pin budgets that only sum past a pool are warned about, one line each."""

from __future__ import annotations

from kvfleet.block_service.tenants import PoolShape, configured, pool_misfits
from kvfleet.core.tenants import MIB, Tenant

POOL = PoolShape("n0", 16, MIB // 4)  # 16 blocks of 1/4 MiB: 4 MiB


def test_a_pool_that_fits_has_nothing_to_say():
    tenants = [Tenant("a", quota_mib=4, reserved_mib=1, cache_share_mib=2, pinned_mib=1), Tenant("b", quota_mib=2)]
    assert pool_misfits(tenants, [POOL]) == ([], [])


def test_a_pin_budget_past_the_whole_pool_is_refused_naming_tenant_field_and_node():
    refused, warned = pool_misfits([Tenant("a", pinned_mib=5), Tenant("b")], [POOL, PoolShape("n1", 64, MIB // 4)])
    assert refused == ["tenant 'a': pinned_mib 5 is 20 blocks, past node n0's pool of 16 blocks (4 MiB)"]
    assert warned == ["tenants' pin budgets sum to 20 blocks, past node n0's pool of 16 blocks (4 MiB): "
                      "pins may hold every cached block"]


def test_sums_past_a_pool_are_warned_each_in_one_line():
    tenants = [Tenant("a", quota_mib=4, reserved_mib=3, cache_share_mib=3, pinned_mib=3),
               Tenant("b", quota_mib=4, reserved_mib=2, pinned_mib=2)]
    refused, warned = pool_misfits(tenants, [POOL])
    assert refused == []
    assert [w.split(" sum to ")[0] for w in warned] == ["tenants' cache shares", "tenants' reserved shares",
                                                        "tenants' pin budgets"]
    assert warned[0].startswith("tenants' cache shares sum to 20 blocks, past node n0's pool of 16 blocks")
    assert warned[0].endswith("they act as weights (the fair policies need no scaling)")


def test_reservations_standing_in_for_shares_are_warned_about_once():
    _, warned = pool_misfits([Tenant("a", quota_mib=4, reserved_mib=3), Tenant("b", quota_mib=4, reserved_mib=2)],
                             [POOL])
    assert len(warned) == 1 and warned[0].startswith("tenants' reserved shares sum to 20 blocks")


def test_no_node_registered_nothing_to_check_against():
    assert pool_misfits([Tenant("a", pinned_mib=1000)], []) == ([], [])


def test_a_configuration_replaces_all_or_updates_by_name():
    a, b, a2, c = Tenant("a"), Tenant("b"), Tenant("a", quota_mib=1), Tenant("c")
    assert configured([a, b], [a2, c], replace_all=False) == [a2, b, c]
    assert configured([a, b], [a2], replace_all=True) == [a2]


def test_the_pin_budget_reaches_block_service_over_the_wire_and_in_its_log():
    from kvfleet.block_service.tenants import tenant_from_record, tenant_to_record
    from kvfleet.block_service.wire import tenant_from_pb, tenant_to_pb

    t = Tenant("t", quota_mib=4, pinned_mib=1.5)
    assert tenant_from_pb(tenant_to_pb(t)) == t == tenant_from_record(tenant_to_record(t))
    assert tenant_from_record({"name": "old", "quota_mib": 1.0}).pinned_mib == 0  # records before pins
