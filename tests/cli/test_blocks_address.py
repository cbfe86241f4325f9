"""Which block_service ``kvfleet blocks`` asks when it is not told (pure: etcd's answer is passed in)."""

from __future__ import annotations

from kvfleet.cli.blocks import DEFAULT_ADDRESS, block_service_address
from kvfleet.cli.cluster_state import ClusterState


def state(*replicas: str, etcd: str = "http://127.0.0.1:2379") -> ClusterState:
    return ClusterState("127.0.0.1:1", 1, None, "/tmp", replicas, etcd)


def no_etcd(url: str) -> str | None:
    raise AssertionError("etcd is not asked")


def test_the_flag_wins_then_the_local_cluster_then_the_default():
    assert block_service_address("10.0.0.1:9", state("127.0.0.1:5"), no_etcd) == "10.0.0.1:9"
    assert block_service_address(None, state("127.0.0.1:5"), no_etcd) == "127.0.0.1:5"
    assert block_service_address(None, None, no_etcd) == DEFAULT_ADDRESS
    assert block_service_address(None, state(), no_etcd) == DEFAULT_ADDRESS  # a state file of an older up


def test_with_a_standby_the_leader_etcd_names_and_a_replica_when_etcd_cannot_say():
    two = state("127.0.0.1:5", "127.0.0.1:6")
    assert block_service_address(None, two, lambda url: "127.0.0.1:6") == "127.0.0.1:6"
    assert block_service_address(None, two, lambda url: None) == "127.0.0.1:5"

    def etcd_down(url: str) -> str | None:
        raise ConnectionError("etcd is down")

    assert block_service_address(None, two, etcd_down) == "127.0.0.1:5"


def test_a_state_file_round_trips_its_replicas(tmp_path):
    import os

    path = tmp_path / "cluster.json"
    ClusterState("127.0.0.1:1", os.getpid(), "sk", "/w", ("127.0.0.1:5", "127.0.0.1:6"), "http://e").write(path)
    read = ClusterState.read(path)
    assert read.block_service == ("127.0.0.1:5", "127.0.0.1:6") and read.etcd == "http://e"
