"""A canary through real processes: a third node in group canary, the split set in etcd by the
operator's CLI while the router runs, sticky conversations, etcd refusing anyone but admin, the
report from the router's own per-request outcomes, and a canary config that does not load."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace

import pytest
from cluster_helpers import random_prompt, request, stream
from test_cluster_kv_fetch import published

from kvfleet.cli.canary_cluster import CanaryNodes, CanaryPlan
from kvfleet.cli.up import UpSettings
from kvfleet.core import certs
from kvfleet.core.canary import CANARY_PREFIX, SPLIT, CanarySplit
from kvfleet.core.identity import ADMIN_ID, ROUTER_ID
from kvfleet.core.membership import etcd_client
from kvfleet.core.tls import Credentials

pytestmark = [pytest.mark.process, pytest.mark.cluster]  # a LocalCluster and its canary node


def canary_cli(cluster, *args: str, certs_dir=None) -> subprocess.CompletedProcess:
    certs_dir = certs_dir or certs.identity_dir(cluster.certs.root, ADMIN_ID)
    env = {**os.environ, "KVFLEET_STATE_FILE": str(cluster.work_dir / "no-state.json")}
    return subprocess.run([sys.executable, "-m", "kvfleet.cli.cli", "canary", *args, "--etcd", cluster.etcd.url,
                           "--router-metrics", cluster.metrics_urls["router"], "--certs", str(certs_dir)],
                          capture_output=True, text=True, env=env, timeout=120)


def samples(cluster) -> dict:
    url = cluster.metrics_urls["router"].removesuffix("/metrics") + "/canary/samples"
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


def router_share(cluster, share: float, timeout: float = 30.0) -> None:
    """Until the router follows a split of ``share``."""
    deadline = time.monotonic() + timeout
    while (samples(cluster)["split"] or {}).get("share") != share:
        assert time.monotonic() < deadline, f"the router did not follow share {share}: {samples(cluster)}"
        time.sleep(0.1)


def served_by(cluster, prompt) -> str:
    chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=3, ignore_eos=True))
    return chunks[-1].node_id


@pytest.fixture
def canary_cluster(start_cluster):
    cluster = start_cluster(2)
    canary = CanaryNodes(cluster, CanaryPlan("canary.yaml", "batch_wait_ms: 1\n",
                                             replace(cluster.node, batch_wait_ms=1.0)), ["node-2"])
    canary.start(timeout=120)
    return cluster


def test_the_split_is_set_while_running_sticky_and_routes_inside_the_chosen_group(canary_cluster):
    cluster = canary_cluster
    assert {n: info.group for n, info in published(cluster).items()} == {
        "node-0": "stable", "node-1": "stable", "node-2": "canary"}
    router_share(cluster, 0.0)
    prompts = [random_prompt(40, seed=900 + i) for i in range(12)]
    assert {served_by(cluster, p) for p in prompts} <= {"node-0", "node-1"}  # share 0: the canary idles

    done = canary_cli(cluster, "start", "--share", "1")
    assert done.returncode == 0, done.stderr
    router_share(cluster, 1.0)
    assert {served_by(cluster, p) for p in prompts[:4]} == {"node-2"}

    assert canary_cli(cluster, "start", "--share", "0.5").returncode == 0
    router_share(cluster, 0.5)
    first = [served_by(cluster, p) == "node-2" for p in prompts]
    assert first == [served_by(cluster, p) == "node-2" for p in prompts]  # each conversation stays in its group
    assert 0 < sum(first) < len(prompts)

    bad = canary_cli(cluster, "start", "--share", "1.5")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "share must be in [0, 1]" in bad.stderr

    report = canary_cli(cluster, "report", "--json", "--resamples", "50")
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["requests"]["canary"] > 0 and data["requests"]["stable"] > 0
    assert data["ready_nodes"] == {"stable": 2, "canary": 1}
    assert {m["metric"] for m in data["metrics"]} >= {"ttft_p99_s", "itl_p50_s", "error_rate"}


def test_only_admin_may_write_the_split(canary_cluster):
    cluster = canary_cluster
    as_router = canary_cli(cluster, "start", "--share", "1", certs_dir=certs.identity_dir(cluster.certs.root,
                                                                                         ROUTER_ID))
    assert as_router.returncode != 0 and as_router.stderr.count("\n") == 1

    async def put_as_router():
        router = Credentials.load(certs.identity_dir(cluster.certs.root, ROUTER_ID), ROUTER_ID)
        async with etcd_client(cluster.etcd.url, credentials=router) as client:
            await client.put((CANARY_PREFIX + SPLIT).encode(), CanarySplit(1.0).to_json())

    with pytest.raises(Exception, match="(?i)permission denied"):
        asyncio.run(put_as_router())
    assert (samples(cluster)["split"] or {}).get("share") == 0.0


def test_a_canary_config_that_does_not_load_leaves_the_split_at_zero_and_says_why(start_cluster, tmp_path):
    cluster = start_cluster(2)
    bad = tmp_path / "canary.yaml"
    bad.write_text("block_size: 17\n")
    plan = CanaryPlan.load(str(bad), UpSettings, {})
    assert plan.node is None and "block-size" in plan.problem
    CanaryNodes(cluster, plan, ["node-2"]).start(timeout=60)
    assert "node-2" not in cluster.nodes and "node-2" not in published(cluster)
    refused = canary_cli(cluster, "start", "--share", "0.1")
    assert refused.returncode == 2 and "the canary group cannot serve" in refused.stderr
    report = canary_cli(cluster, "report", "--resamples", "20")
    assert "the canary serves nothing: the canary config does not load" in report.stdout
    promote = canary_cli(cluster, "promote")
    assert promote.returncode == 2 and "promote refused: the canary group is unhealthy: the canary config" in \
        promote.stderr
