"""block_service with a standby: the leader SIGKILLed under load, the standby takes over
through etcd, the nodes and the router find it there and every stream finishes token-exact. Real
etcd, two block_service replicas, nodes and router (LocalCluster), a shortened lease."""

from __future__ import annotations

import pytest
from cluster_helpers import Streams
from test_node_survival import MAX_TOKENS, expected, generate, no_live_sequences, pids, until  # noqa: F401

pytestmark = pytest.mark.chaos  # each test kills or stops a part of the cluster on purpose

LEASE_TTL = 2


def test_the_standby_takes_over_when_the_leader_is_killed_under_load(start_cluster, expected):  # noqa: F811
    prompts, want = expected
    cluster = start_cluster(2, block_service_standby=True, lease_ttl_s=LEASE_TTL,
                            compute_args=("--reconcile-interval", "5"))
    leader = until("a block_service leader", cluster.block_service_leader)
    assert leader == f"127.0.0.1:{cluster.block_service.port}"
    before = pids(cluster)
    streams = Streams(cluster.router_address, prompts, MAX_TOKENS)
    streams.wait_decoding()                  # every stream is decoding
    cluster.kill("block_service")            # SIGKILL the leader: its lease lapses, no restart
    standby = f"127.0.0.1:{cluster.block_service_standby.port}"
    until("the standby leads", lambda: cluster.block_service_leader() == standby)
    results = streams.join()
    assert results == want                   # every stream finished, token-exact
    assert pids(cluster) == before and all(c.alive() for c in cluster.nodes.values())
    assert generate(cluster, prompts[0]) == want[0]  # a new request, its blocks from the new leader
    until("the new leader holds nothing for the idle nodes", lambda: no_live_sequences(cluster))
    for node in cluster.nodes.values():
        assert "block_service leader is " + standby in node.log_path.read_text()
