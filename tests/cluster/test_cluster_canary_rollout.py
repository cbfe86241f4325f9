"""Promote and rollback through a real cluster: the operator's CLI asks (etcd), the supervisor's
code (``CanaryNodes.poll``, what ``kvfleet up`` runs) restarts the nodes one at a time, each drained
first, while streams run: every stream ends with all its tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest
from cluster_helpers import Streams, random_prompt
from test_cluster_canary import canary_cli
from test_cluster_kv_fetch import published

from kvfleet.cli.canary_cluster import CanaryNodes, CanaryPlan

pytestmark = [pytest.mark.process, pytest.mark.cluster]  # a LocalCluster and its canary nodes

MAX_TOKENS = 48


def batch_wait(cluster, node_id: str) -> float | None:
    """The node's ``--batch-wait-ms`` on its command line (None: the default)."""
    argv = cluster.nodes[node_id].argv
    return float(argv[argv.index("--batch-wait-ms") + 1]) if "--batch-wait-ms" in argv else None


def under_streams(cluster, canary: CanaryNodes, seed: int) -> list:
    """``canary.poll()`` (the rollout etcd asks for) while streams decode; their results."""
    streams = Streams(cluster.router_address, [random_prompt(40, seed=seed + i) for i in range(4)], MAX_TOKENS)
    streams.wait_decoding()
    canary.poll()  # on this thread: a node dies with the thread that started it (PR_SET_PDEATHSIG)
    streams.join()
    return streams.results


def test_rollback_then_promote_restart_nodes_one_at_a_time_and_lose_no_request(start_cluster):
    cluster = start_cluster(2)
    canary = CanaryNodes(cluster, CanaryPlan("c.yaml", "batch_wait_ms: 1\n", replace(cluster.node, batch_wait_ms=1.0)),
                         ["node-2"])
    canary.start(timeout=120)
    assert canary_cli(cluster, "start", "--share", "0.5").returncode == 0
    assert batch_wait(cluster, "node-2") == 1.0

    assert canary_cli(cluster, "rollback").returncode == 0
    results = under_streams(cluster, canary, seed=700)
    assert all(isinstance(r, list) and len(r) == MAX_TOKENS for r in results), results
    assert {n: i.group for n, i in published(cluster).items()} == {"node-0": "stable", "node-1": "stable",
                                                                   "node-2": "stable"}
    assert batch_wait(cluster, "node-2") is None  # the stable configuration again

    refused = canary_cli(cluster, "promote")  # no canary group left
    assert refused.returncode == 2 and "promote refused: the canary group is unhealthy" in refused.stderr

    canary = CanaryNodes(cluster, CanaryPlan("c.yaml", "batch_wait_ms: 1\n", replace(cluster.node, batch_wait_ms=1.0)),
                         ["node-3"])
    canary.start(timeout=120)
    assert canary_cli(cluster, "promote").returncode == 0
    results = under_streams(cluster, canary, seed=800)
    assert all(isinstance(r, list) and len(r) == MAX_TOKENS for r in results), results
    nodes = published(cluster)
    assert {i.group for i in nodes.values()} == {"stable"} and {i.state.value for i in nodes.values()} == {"READY"}
    assert {batch_wait(cluster, n) for n in cluster.nodes} == {1.0}  # the canary's configuration everywhere
    assert canary_cli(cluster, "report", "--resamples", "20").returncode == 0
