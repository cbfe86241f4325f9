"""Prefix-cache lookups per tenant: queries, and hits by the tier they came from (pure)."""

from __future__ import annotations

from dataclasses import replace

from kvfleet.compute_service.kv.tenant_lookups import FetchedBlocks, TenantLookups, counted
from kvfleet.compute_service.kv.tier_index import PrefixLookups
from kvfleet.core.allocator import TIER_DISK, TIER_HOST
from kvfleet.core.tenants import WARMUP_TENANT

H = [bytes([i]) * 16 for i in range(8)]


def test_hits_are_counted_by_tier_and_the_node_totals_stay_as_they_were():
    lookups = PrefixLookups()
    lookups.add(2, [TIER_HOST, TIER_DISK], 5, "a", H[:2])
    lookups.add(0, [], 3, "b", [])
    assert (lookups.hot, lookups.host, lookups.disk, lookups.miss) == (2, 1, 1, 4)
    assert lookups.by_tenant == {"a": TenantLookups(queries=5, device=2, host=1, disk=1),
                                 "b": TenantLookups(queries=3)}


def test_a_fetched_block_is_the_peers_at_its_first_hit_and_the_devices_after():
    lookups = PrefixLookups()
    lookups.fetched.add(H[1:3])
    lookups.add(3, [], 4, "a", H[:3])
    assert lookups.by_tenant["a"] == TenantLookups(queries=4, device=1, peer=2)
    lookups.add(3, [], 4, "a", H[:3])
    assert lookups.by_tenant["a"] == TenantLookups(queries=8, device=4, peer=2)
    assert len(lookups.fetched) == 0


def test_the_warm_up_tenant_and_an_admission_with_nothing_to_look_up_are_not_counted():
    lookups = PrefixLookups()
    lookups.add(1, [], 2, WARMUP_TENANT, H[:1])
    lookups.add(0, [], 0, "a", [])
    assert lookups.by_tenant == {}
    assert lookups.hot == 1  # the node's own figure keeps counting everything, as before


def test_a_reading_stays_as_it_was_while_counting_goes_on():
    lookups = PrefixLookups()
    lookups.add(1, [], 2, "a", H[:1])
    reading = replace(lookups)  # what the engine's stats hand the metrics thread
    lookups.add(2, [], 2, "a", H[:2])
    lookups.add(0, [], 1, "b", [])
    assert reading.by_tenant == {"a": TenantLookups(queries=2, device=1)}
    assert len(reading.fetched) == 0 and reading.by_tenant is not lookups.by_tenant


def test_the_fetched_memory_is_bounded_and_forgets_the_oldest():
    fetched = FetchedBlocks(capacity=2)
    fetched.add(H[:3])
    assert len(fetched) == 2
    assert fetched.take(H[:3]) == 2  # H[0] was forgotten: its hit counts as the device's
    assert counted({}, "a", 1, H[:1], [], fetched) == {"a": TenantLookups(queries=1, device=1)}


def test_hits_by_tier_name_every_tier():
    assert TenantLookups(queries=9, device=1, host=2, disk=3, peer=4).hits() == {
        "device": 1, "host": 2, "disk": 3, "peer": 4}
