"""Prefill and decode on separate nodes, as separate processes: a long prompt is prefilled on the
prefill node, its first token streamed, and the sequence handed to the decode node, which fetches
the prompt's KV and continues: one stream, every token once, the same tokens as one node alone, the
tenant's quota charged once. A prefill node killed before the hand-over costs a retry, not a token."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

from cluster_helpers import BLOCK_SIZE, block_pools, random_prompt, released_pool, request, stream
from node_direct import metric, node_metrics, run_on
from test_cluster_kv_fetch import published

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.cli.local_nodes import node_roles
from kvfleet.core.tenants import Tenant

PROMPT_BLOCKS = 6
MAX_TOKENS = 12
ROUTER = ("--disagg-min-uncached-tokens", str(2 * BLOCK_SIZE))


def disaggregated(start_cluster):
    return start_cluster(2, roles=node_roles(2, prefill=1, decode=1), router_args=ROUTER)


def quota_of_blocks(cluster, tenant: str, blocks: int) -> None:
    """``tenant`` may hold ``blocks`` of the nodes' blocks at once (block_service enforces it)."""
    mib = blocks * block_pools(cluster)["node-0"].bytes_per_block / (1 << 20)

    async def configure():
        async with BlockManagerClient(cluster.block_service_address) as client:
            await client.configure_tenants([Tenant(tenant, quota_mib=mib, paid_level=2)])

    asyncio.run(configure())


def test_a_long_prompt_is_prefilled_on_one_node_and_decoded_on_the_other(start_cluster):
    cluster = disaggregated(start_cluster)
    assert {n: info.role for n, info in published(cluster).items()} == {"node-0": "prefill", "node-1": "decode"}
    prompt = random_prompt(PROMPT_BLOCKS * BLOCK_SIZE + 5, seed=291)
    alone = run_on(cluster, "node-0", "alone", prompt, MAX_TOKENS)  # the whole request on one node
    # one copy of the prompt's blocks and the generated ones fit; two copies would not
    quota_of_blocks(cluster, "gold", PROMPT_BLOCKS + 3)

    chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == alone.tokens                                  # one stream, every token once, exact
    assert chunks[0].node_id == "node-0" and chunks[-1].node_id == "node-1"  # first token from the prefill node
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    router = node_metrics(cluster, "router")
    assert metric(router, "kvfleet:router_handovers_total") == 1
    assert metric(router, "kvfleet:router_handover_seconds_count") == 1
    decode = node_metrics(cluster, "node-1")
    assert metric(decode, "kvfleet:kv_fetch_decisions_total", decision="handover") == 1
    assert metric(decode, "kvfleet:kv_fetch_blocks_total") == PROMPT_BLOCKS  # the prompt's KV came over
    assert metric(decode, "kvfleet:kv_fetch_fallbacks_total") == 0
    assert metric(decode, "kvfleet:node_role", role="decode") == 1
    for node_id in ("node-0", "node-1"):
        released_pool(cluster, node_id)


def test_a_short_prompt_runs_where_it_lands(start_cluster):
    cluster = disaggregated(start_cluster)
    prompt = random_prompt(BLOCK_SIZE + 3, seed=293)  # below the threshold: no hand-over
    chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=6, ignore_eos=True))
    assert {c.node_id for c in chunks} == {"node-1"}  # the decode node, never the prefill node
    assert metric(node_metrics(cluster, "router"), "kvfleet:router_handovers_total") == 0
    shown = subprocess.run([sys.executable, "-m", "kvfleet.cli", "blocks", "--json", "--block-service",
                            cluster.block_service_address, "--etcd", cluster.etcd.url,
                            "--certs", str(cluster.certs.root / "admin")], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert {n["node_id"]: n["role"] for n in json.loads(shown.stdout)["nodes"]} == {"node-0": "prefill",
                                                                                   "node-1": "decode"}


def test_a_prefill_node_killed_before_the_hand_over_costs_a_retry(start_cluster):
    cluster = disaggregated(start_cluster)
    prompt = random_prompt(PROMPT_BLOCKS * BLOCK_SIZE + 5, seed=294)
    reference = run_on(cluster, "node-1", "reference", prompt[:-1] + [prompt[-1] ^ 1], MAX_TOKENS)
    assert not reference.error
    cluster.kill_node("node-0", signal.SIGSTOP)  # it takes the prompt and never answers
    got: list = []
    client = threading.Thread(target=lambda: got.append(stream(
        cluster.router_address, request(tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True))))
    client.start()
    time.sleep(2.0)
    cluster.kill_node("node-0", signal.SIGKILL)  # before its first token: the router retries elsewhere
    client.join(120)
    [chunks] = got
    assert {c.node_id for c in chunks} == {"node-1"}
    assert [t for c in chunks for t in c.token_ids] == run_on(cluster, "node-1", "again", prompt, MAX_TOKENS).tokens
    assert metric(node_metrics(cluster, "router"), "kvfleet:router_handovers_total") == 0
    released_pool(cluster, "node-1")
