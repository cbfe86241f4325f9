"""The partition bed's fixtures: one cluster in network namespaces per module (a start costs ~30 s),
stopped and its namespaces removed even when a test fails; a clear skip where namespaces cannot be
made (not root, no ``ip``/``iptables``)."""

from __future__ import annotations

import pytest

from kvfleet_cli.model_maker import make_model
from kvfleet_cli.partition import scenarios
from kvfleet_cli.partition.bed_cluster import BED_TENANTS
from kvfleet_cli.partition.netns import why_unavailable
from kvfleet_cli.partition.scenarios import MAX_TOKENS


@pytest.fixture(scope="module")
def bed_cluster(tmp_path_factory):
    """(a started BedCluster, its prompts, their fault-free tokens)."""
    reason = why_unavailable()
    if reason:
        pytest.skip(f"no partition bed here: {reason}")
    from kvfleet_cli.partition.bed_cluster import BedCluster
    from kvfleet_cli.partition.history import StreamClients

    work = tmp_path_factory.mktemp("partition")
    model = make_model(work / "tiny", "tiny", seed=11)
    (work / "tenants.yaml").write_text(BED_TENANTS)
    cluster = BedCluster(model, work / "cluster", work / "tenants.yaml", lease_ttl_s=3).start()
    try:
        prompt_list = scenarios.prompts()
        reference = StreamClients(cluster.router_address, prompt_list, MAX_TOKENS).reference()
        yield cluster, prompt_list, reference
    finally:
        cluster.stop()
