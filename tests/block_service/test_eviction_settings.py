"""Choosing an eviction policy and giving tenants their shares: ``--eviction-policy`` on
``kvfleet block-service`` and ``kvfleet up`` (passed on to block_service's command line), a bad name
one line listing the choices; ``cache_share_mib`` in the tenants file, over the wire and in the log's
records, a negative one refused in one line; a share is the reserve unless given."""

from __future__ import annotations

import argparse

import pytest

from kvfleet.block_service import main as block_service_main
from kvfleet.block_service.eviction import NAMES
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.settings import BlockServiceSettings, EvictionSettings
from kvfleet.block_service.tenants import cache_shares, tenant_from_record, tenant_to_record
from kvfleet.block_service.wire import tenant_from_pb, tenant_to_pb
from kvfleet.cli import up
from kvfleet.core.settings import SettingError, build, to_argv
from kvfleet.core.tenants import MIB, Tenant, TenantsFileError, parse_tenants


def parsed(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("name", NAMES)
def test_block_service_and_up_take_every_policy(name: str) -> None:
    blocks = build(BlockServiceSettings, parsed(block_service_main.add_arguments, ["--eviction-policy", name]))
    assert blocks.eviction.eviction_policy == name
    assert build(BlockServiceSettings, parsed(block_service_main.add_arguments, to_argv(blocks))) == blocks
    ups = build(up.UpSettings, parsed(up.add_arguments, ["--eviction-policy", name]))
    assert ups.eviction.eviction_policy == name


def test_a_bad_policy_is_one_line_naming_the_choices() -> None:
    for add_arguments, settings in ((block_service_main.add_arguments, BlockServiceSettings),
                                    (up.add_arguments, up.UpSettings)):
        with pytest.raises(SettingError) as refused:
            build(settings, parsed(add_arguments, ["--eviction-policy", "mru"]))
        assert str(refused.value) == "--eviction-policy must be one of auto, lru, value, fair, fair+value, got 'mru'"


def test_up_passes_on_the_flags_block_service_reads_back() -> None:
    """``kvfleet up`` hands its ``EvictionSettings`` to the local cluster, which puts ``to_argv`` of
    them on block_service's command line (``bench/tenant_fairness.py`` runs clusters that way)."""
    ups = build(up.UpSettings, parsed(up.add_arguments, ["--eviction-policy", "fair+value"]))
    argv = to_argv(ups.eviction)
    assert argv == ["--eviction-policy", "fair+value"] and to_argv(EvictionSettings()) == []
    assert build(BlockServiceSettings, parsed(block_service_main.add_arguments, argv)).eviction == ups.eviction


def entry(**over) -> dict:
    return {"name": "t", "api_key": "k", "quota_mib": 4, "paid_level": 0, "max_concurrent": 1, **over}


def test_a_share_is_given_or_the_reserve() -> None:
    given, reserve, none = parse_tenants({"tenants": [entry(cache_share_mib=2.5), entry(name="r", api_key="r",
                                                      reserved_mib=1), entry(name="n", api_key="n")]})
    assert given.cache_share_mib == 2.5 and reserve.cache_share_mib is None
    bpb = MIB // 4
    assert cache_shares([given, reserve, none], bpb) == {"t": 10, "r": 4}
    zero = Tenant("z", quota_mib=4, reserved_mib=1, cache_share_mib=0)  # an explicit 0: no share, whatever the reserve
    assert cache_shares([zero], bpb) == {}
    big = Tenant("big", cache_share_mib=1 << 20)  # past any pool: a weight (kvfleet.block_service.eviction.fair)
    assert cache_shares([big], bpb) == {"big": 4 << 20}


@pytest.mark.parametrize("value, words", [
    (-1, "tenants[0] (t): cache_share_mib must be >= 0, got -1.0"),
    ("lots", "tenants[0] (t): cache_share_mib must be a number, got 'lots'"),
    (float("nan"), "tenants[0] (t): cache_share_mib must be >= 0, got nan"),
])
def test_a_bad_share_is_one_line(value, words: str) -> None:
    with pytest.raises(TenantsFileError) as refused:
        parse_tenants({"tenants": [entry(cache_share_mib=value)]})
    assert str(refused.value) == f"tenants file: {words}" and "\n" not in str(refused.value)


def test_the_share_survives_the_wire_the_log_and_a_snapshot() -> None:
    t = Tenant("t", quota_mib=4, cache_share_mib=1.5)
    assert tenant_from_pb(tenant_to_pb(t)) == t == tenant_from_record(tenant_to_record(t))
    unset = Tenant("u", quota_mib=4)
    assert tenant_from_pb(tenant_to_pb(unset)).cache_share_mib is None
    assert tenant_from_record({"name": "old", "quota_mib": 1.0}).cache_share_mib is None  # records before shares
    table = PageTable("fair")
    table.configure_tenants([t, unset])
    assert PageTable.from_dict(table.to_dict()).tenants() == [t, unset]


def test_auto_takes_the_state_directorys_policy_else_fair(tmp_path) -> None:
    from kvfleet.block_service.durable import DurablePageTable, RecoveryError
    assert EvictionSettings().configured() is None and EvictionSettings("lru").configured() == "lru"
    store, _ = DurablePageTable.open(str(tmp_path / "old"), fsync=False, eviction="lru")  # a state written under lru
    store.close()
    store, _ = DurablePageTable.open(str(tmp_path / "old"), fsync=False)  # auto: kept as written
    assert store.table.eviction == "lru"
    store.close()
    with pytest.raises(RecoveryError, match="written under the eviction policy 'lru'"):
        DurablePageTable.open(str(tmp_path / "old"), fsync=False, eviction="fair")  # asked for another: refused
    fresh, _ = DurablePageTable.open(str(tmp_path / "new"), fsync=False)
    assert fresh.table.eviction == "fair"
    fresh.close()
    before_policies = {k: v for k, v in PageTable().to_dict().items() if k != "eviction"}
    assert PageTable.from_dict(before_policies).eviction == "lru"  # a snapshot from before policies: lru's
