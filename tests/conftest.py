"""Test tiers, set from the fixtures a test uses, so that ``make test-fast`` can leave out whatever
starts real processes without anyone keeping a list of paths up to date.

- ``process``: starts a real process or server (etcd, a kvfleet service or command, any Python
  interpreter in a subprocess);
- ``cluster``: starts a whole cluster (``LocalCluster``, ``kvfleet up``: several services at once);
- ``chaos``: kills or restarts processes on purpose.

A test gets a marker when any fixture in its closure (its own fixtures and the fixtures they use)
is named below; a fixture that starts processes belongs in these tables. A test that starts a
process without such a fixture carries the marker itself (``tests/test_tiers.py`` finds the ones
that don't).
"""

from __future__ import annotations

import pytest

# fixture name -> the markers every test using it gets
FIXTURE_TIERS: dict[str, tuple[str, ...]] = {
    "etcd": ("process",),                    # a real etcd server (tests/cluster, block_service election/replicas)
    "service": ("process",),                 # `kvfleet block-service` in a subprocess (test_block_service_process)
    "replicas": ("process",),                # block_service replicas in subprocesses (test_replicas)
    "start_cluster": ("process", "cluster"),  # tests/cluster/conftest.py: a LocalCluster per test
    "shared_cluster": ("process", "cluster"),  # tests/cluster/conftest.py: one LocalCluster per module
    "cluster": ("process", "cluster"),       # a module's LocalCluster (tests/chaos, test_openai_door)
    "up": ("process", "cluster"),            # `kvfleet up` in a subprocess (test_kvfleet_up)
    "tls_router": ("process", "cluster"),    # a second router, public doors over TLS (test_public_tls)
    "chaos_model": ("process", "cluster", "chaos"),  # tests/chaos: the cluster whose parts the tests kill
    "bed_cluster": ("process", "cluster", "chaos"),  # tests/partition: a cluster in network namespaces, links cut
}


# a cluster is processes; what kills processes started them (a marker written by hand implies these too)
IMPLY: dict[str, tuple[str, ...]] = {"process": (), "cluster": ("process",), "chaos": ("process",)}


def tiers_of(fixturenames) -> set[str]:
    """The markers a test using ``fixturenames`` (its whole closure) gets."""
    return {tier for name in fixturenames for tier in FIXTURE_TIERS.get(name, ())}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        have = {mark.name for mark in item.iter_markers()}
        tiers = tiers_of(getattr(item, "fixturenames", ())) | (have & IMPLY.keys())
        tiers |= {implied for tier in tiers for implied in IMPLY[tier]}
        for tier in sorted(tiers - have):
            item.add_marker(tier)
