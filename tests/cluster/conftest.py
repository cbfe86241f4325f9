"""Process-level fixtures: real servers on loopback, always stopped, even when a test fails."""

from __future__ import annotations

import pytest
from cluster_helpers import BLOCK_SIZE, TENANTS

from kvfleet_cli.etcd_server import EtcdServer
from kvfleet_cli.local_cluster import LocalCluster
from kvfleet_cli.model_maker import make_model


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
        kw.setdefault("dtype", "float32")  # the tests compare tokens with transformers' float32
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
