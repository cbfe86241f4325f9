"""Process-level fixtures: real servers on loopback, always stopped, even when a test fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from cluster_helpers import BLOCK_SIZE, TENANTS

from kvfleet.cli.etcd_server import EtcdServer
from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.cli.model_maker import make_model
from kvfleet.core import tls


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


class Clusters:
    """LocalClusters of the test model under one work directory, with the tests' defaults; all of
    them stopped at the end, and none may leave a process behind."""

    def __init__(self, model_dir: Path, work_dir: Path) -> None:
        self.model_dir, self.work_dir = model_dir, work_dir
        self.started: list[LocalCluster] = []
        self.tenants = work_dir / "tenants.yaml"
        self.tenants.write_text(TENANTS)

    def start(self, num_nodes: int = 2, **kw) -> LocalCluster:
        kw.setdefault("block_size", BLOCK_SIZE)
        kw.setdefault("kv_cache_memory", 16 << 20)
        kw.setdefault("tenants_file", self.tenants)
        kw.setdefault("dtype", "float32")  # the tests compare tokens with transformers' float32
        cluster = LocalCluster(self.model_dir, num_nodes, work_dir=self.work_dir / f"cluster{len(self.started)}", **kw)
        self.started.append(cluster)
        return cluster.start()

    def stop_all(self) -> None:
        for cluster in self.started:
            cluster.stop()
        for cluster in self.started:
            leftovers = [c.name for c in cluster.children() if c.alive()]
            assert not leftovers, f"processes left running: {leftovers}"
            assert cluster.etcd.process is None


@pytest.fixture
def start_cluster(model_dir, tmp_path):
    """``start_cluster(num_nodes=2, **kw)`` → a started LocalCluster, stopped after the test."""
    clusters = Clusters(model_dir, tmp_path)
    try:
        yield clusters.start
    finally:
        clusters.stop_all()


@pytest.fixture(scope="module")
def shared_cluster(model_dir, tmp_path_factory):
    """``shared_cluster(num_nodes=2, **kw)`` → the module's LocalCluster of these settings, started
    by the first test that asks for it and stopped after the module: for tests that only send
    requests and read the answers (a cluster start costs more than most such tests)."""
    clusters = Clusters(model_dir, tmp_path_factory.mktemp("shared-cluster"))
    by_settings: dict[str, LocalCluster] = {}

    def get(num_nodes: int = 2, **kw) -> LocalCluster:
        key = repr((num_nodes, sorted(kw.items())))
        if key not in by_settings:
            by_settings[key] = clusters.start(num_nodes, **kw)
        cluster = by_settings[key]
        dead = cluster.exited()
        assert not dead, f"the module's cluster lost a process to an earlier test: {dead}"
        # this test calls the cluster as its admin: the credentials the cluster's start installed were
        # put back after the test that started it (tests/conftest.py), so each test gets them again here
        tls.use(cluster.certs.admin())
        return cluster

    try:
        yield get
    finally:
        clusters.stop_all()
