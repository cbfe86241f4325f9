"""The partition bed as a fixture's body: a started cluster in network namespaces, its prompts and
their fault-free tokens, stopped and its namespaces removed even when a test fails; a clear skip
where namespaces cannot be made (not root, no ``ip``/``iptables``)."""

from __future__ import annotations

import pytest

from kvfleet.cli.model_maker import make_model
from kvfleet.cli.partition import scenarios
from kvfleet.cli.partition.bed_cluster import BED_TENANTS
from kvfleet.cli.partition.netns import why_unavailable
from kvfleet.cli.partition.scenarios import MAX_TOKENS


def started_bed(tmp_path_factory, name: str, etcd_members: int = 1):
    """Yields (a started BedCluster, its prompts, their fault-free tokens); stops it afterwards."""
    reason = why_unavailable()
    if reason:
        pytest.skip(f"no partition bed here: {reason}")
    from kvfleet.cli.partition.bed_cluster import BedCluster
    from kvfleet.cli.partition.history import StreamClients

    work = tmp_path_factory.mktemp(name)
    (work / "tenants.yaml").write_text(BED_TENANTS)
    cluster = BedCluster(make_model(work / "tiny", "tiny", seed=11), work / "cluster", work / "tenants.yaml",
                         lease_ttl_s=3, etcd_members=etcd_members).start()
    try:
        prompt_list = scenarios.prompts()
        yield cluster, prompt_list, StreamClients(cluster.router_address, prompt_list, MAX_TOKENS).reference()
    finally:
        cluster.stop()
