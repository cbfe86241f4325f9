"""KV between nodes, as separate processes: a prompt prefilled on one node is fetched by the other
instead of prefilled again (same greedy tokens, block_service records the copy), and a holder that
stalls or dies mid-fetch costs the request a prefill, never a token or a block."""

from __future__ import annotations

import asyncio
import signal
import time

from cluster_helpers import BLOCK_SIZE, block_pools, random_prompt, released_pool
from node_direct import generate_on, metric, node_metrics, run_on

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from kvfleet.core.membership import etcd_client, list_nodes

PROMPT_BLOCKS = 6


def hashes_of(prompt: list[int], tenant: str = "gold") -> list[bytes]:
    return block_hashes(prompt, BLOCK_SIZE, tenant_extra_key(tenant))


def held_by(cluster, prompt: list[int]) -> dict[str, int]:
    """Per node, the prompt's leading blocks block_service's index says it holds (any tier)."""
    async def read():
        async with BlockManagerClient(cluster.block_service_address) as client:
            return await client.match_tiers(hashes_of(prompt))

    hot, lower = asyncio.run(read())
    return {n: hot.get(n, 0) + lower.get(n, 0) for n in hot.keys() | lower.keys()}


def published(cluster) -> dict:
    """Node id -> its membership record in etcd now."""
    async def read():
        async with etcd_client(cluster.etcd.url, credentials=cluster.certs.admin()) as client:
            nodes, _ = await list_nodes(client)
        return nodes

    return asyncio.run(read())


def published_rates(cluster) -> dict:
    """Node id -> the KV rates its membership record carries (None: none yet)."""
    return {n: info.kv_rates for n, info in published(cluster).items()}


def test_a_prefix_prefilled_on_one_node_is_fetched_by_the_other(start_cluster):
    cluster = start_cluster(2, compute_args=("--kv-fetch", "always"))
    prompt = random_prompt(PROMPT_BLOCKS * BLOCK_SIZE + 5, seed=281)
    first = run_on(cluster, "node-0", "first", prompt, max_tokens=12)
    assert not first.error and first.cached_tokens == 0
    assert held_by(cluster, prompt).get("node-0") == PROMPT_BLOCKS

    again = run_on(cluster, "node-1", "again", prompt, max_tokens=12)
    assert not again.error
    assert again.tokens == first.tokens                      # float32: a fetched prefix changes nothing
    assert again.cached_tokens == PROMPT_BLOCKS * BLOCK_SIZE  # every full block came from node-0
    held = held_by(cluster, prompt)
    assert held.get("node-1") == PROMPT_BLOCKS and held.get("node-0") == PROMPT_BLOCKS  # the copy is recorded
    samples = node_metrics(cluster, "node-1")
    assert metric(samples, "kvfleet:kv_fetch_blocks_total") == PROMPT_BLOCKS
    assert metric(samples, "kvfleet:kv_fetch_bytes_total") > 0
    assert metric(samples, "kvfleet:kv_fetch_decisions_total", decision="fetch") == 1
    assert metric(samples, "kvfleet:kv_fetch_seconds_count") == 1
    assert metric(samples, "kvfleet:kv_fetch_fallbacks_total") == 0
    assert metric(node_metrics(cluster, "node-0"), "kvfleet:kv_fetch_blocks_total") == 0
    for node_id in ("node-0", "node-1"):
        released_pool(cluster, node_id)  # nothing held once both ended
    deadline = time.monotonic() + 30  # the fetch's measured rate reaches the routers through etcd
    while not (rates := published_rates(cluster))["node-1"].fetch_bytes_per_s and time.monotonic() < deadline:
        time.sleep(0.5)
    assert rates["node-1"].fetch_bytes_per_s > 0 and rates["node-1"].prefill_tokens_per_s > 0
    assert rates["node-0"].fetch_bytes_per_s == 0 and rates["node-0"].bytes_per_token > 0


def test_a_holder_stopped_then_killed_mid_fetch_costs_a_prefill_not_a_token(start_cluster):
    cluster = start_cluster(2, compute_args=("--kv-fetch", "always", "--kv-fetch-min-deadline-s", "20"))
    prompts = [random_prompt(PROMPT_BLOCKS * BLOCK_SIZE + 3, seed=s) for s in (282, 283)]
    reference = [run_on(cluster, "node-0", f"ref-{i}", p, max_tokens=10) for i, p in enumerate(prompts)]
    assert all(not r.error for r in reference)

    async def stalled_then_killed():
        cluster.kill_node("node-0", signal.SIGSTOP)  # still listed, still holding: its fetch hangs
        waiting = asyncio.create_task(generate_on(cluster, "node-1", "during", prompts[0], 10))
        await asyncio.sleep(2.0)
        assert not waiting.done()                      # waiting on the holder, not computing yet
        in_flight = await asyncio.to_thread(block_pools, cluster)  # what `kvfleet blocks` shows
        assert (in_flight["node-1"].transfers_in_flight, in_flight["node-1"].transfer_blocks_in_flight) == \
            (1, PROMPT_BLOCKS)
        cluster.kill_node("node-0", signal.SIGKILL)    # mid-fetch: the stream breaks
        during = await asyncio.wait_for(waiting, 60)
        after = await generate_on(cluster, "node-1", "after", prompts[1], 10)  # the holder is gone
        return during, after

    during, after = asyncio.run(stalled_then_killed())
    assert not during.error and not after.error
    assert during.tokens == reference[0].tokens and after.tokens == reference[1].tokens
    assert during.cached_tokens == 0
    samples = node_metrics(cluster, "node-1")
    assert metric(samples, "kvfleet:kv_fetch_blocks_total") == 0
    assert metric(samples, "kvfleet:kv_fetch_fallbacks_total", reason="peer") >= 1
    released_pool(cluster, "node-1")  # the fetch's reserved blocks went back
