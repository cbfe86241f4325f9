"""Process-level fixtures: real servers on loopback, always stopped, even when a test fails."""

from __future__ import annotations

import pytest
from cluster_helpers import BLOCK_SIZE

from kvfleet_cli.etcd_server import EtcdServer
from kvfleet_cli.local_cluster import DEMO_TENANTS, LocalCluster
from kvfleet_cli.model_maker import make_model

# The demo tenants (gold, free) and one with a quota of 3 blocks of the test model.
TENANTS = DEMO_TENANTS + """\
  - name: tiny
    api_key: sk-tiny
    quota_mib: 0.1
    paid_level: 0
    max_concurrent: 4
"""


@pytest.fixture(scope="module")
def etcd():
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("cluster-model") / "tiny", "tiny", seed=11)


@pytest.fixture
def start_cluster(model_dir, tmp_path):
    """``start_cluster(num_nodes=2, **kw)`` → a started LocalCluster, stopped after the test."""
    started: list[LocalCluster] = []
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)

    def start(num_nodes: int = 2, **kw) -> LocalCluster:
        kw.setdefault("block_size", BLOCK_SIZE)
        kw.setdefault("kv_cache_memory", 16 << 20)
        kw.setdefault("tenants_file", tenants)
        cluster = LocalCluster(model_dir, num_nodes, work_dir=tmp_path / f"cluster{len(started)}", **kw)
        started.append(cluster)
        return cluster.start()

    try:
        yield start
    finally:
        for cluster in started:
            cluster.stop()
        for cluster in started:
            leftovers = [c.name for c in cluster.children() if c.alive()]
            assert not leftovers, f"processes left running: {leftovers}"
            assert cluster.etcd.process is None
