"""A node restarted with ``--kv-snapshot-dir`` comes back warm: the blocks it wrote on drain are in
its pool and block_service lists them as cached for it before it turns READY, and a request on
their prefix is served from them with the tokens it had before. A snapshot taken with another
block size is refused in one line and the node starts cold. Real etcd, block_service, node, router.
"""

from __future__ import annotations

import asyncio
import signal

import cluster_helpers
import pytest
from cluster_helpers import BLOCK_SIZE, random_prompt, request, tokens_of

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.core.block_hash import block_hashes

PREFIX = random_prompt(6 * BLOCK_SIZE + 5, seed=70)
PROMPTS = [PREFIX + random_prompt(9, seed=71 + i) for i in range(3)]
PREFIX_BLOCKS = len(PREFIX) // BLOCK_SIZE


def generate(cluster, prompt: list[int]) -> tuple[list[int], int]:
    """(greedy tokens, cached prompt tokens) of ``prompt`` through the router, as tenant gold."""
    chunks = cluster_helpers.stream(cluster.router_address, request(tokens=prompt, max_tokens=8, ignore_eos=True))
    return tokens_of(chunks), chunks[-1].usage.cached_tokens


def cached_prefix_blocks(cluster, block_size: int) -> int:
    """How many leading blocks of PREFIX (tenant gold) block_service holds committed on node-0."""
    async def ask():
        async with BlockManagerClient(cluster.block_service_address) as client:
            return await client.match_prefix(block_hashes(PREFIX, block_size, b"gold"), ["node-0"])

    return asyncio.run(ask()).get("node-0", 0)


def drain(cluster) -> None:
    cluster.kill("node-0", signal.SIGTERM)
    assert cluster.child("node-0").process.wait(timeout=60) == 0


@pytest.mark.chaos
def test_a_node_restarts_warm_from_its_snapshot_and_refuses_another_block_size(start_cluster, tmp_path):
    snapshots = tmp_path / "snapshots"
    cluster = start_cluster(num_nodes=1, compute_args=("--kv-snapshot-dir", str(snapshots)))
    before = [generate(cluster, p) for p in PROMPTS]
    assert [cached for _, cached in before[1:]] == [PREFIX_BLOCKS * BLOCK_SIZE] * 2
    drain(cluster)
    assert [p.name for p in snapshots.iterdir()] == ["kv-snapshot-node-0.safetensors"]
    assert "KV snapshot (drain) of " in cluster.child("node-0").log_tail(200)

    cluster.restart("node-0")
    cluster.wait_ready(["node-0"])
    log = cluster.child("node-0").log_tail(200)
    assert "node node-0: restored " in log and "refused" not in log
    # READY means restored and known to block_service: the whole prefix is cached there for node-0
    assert cached_prefix_blocks(cluster, BLOCK_SIZE) == PREFIX_BLOCKS
    pool = cluster_helpers.block_pools(cluster)["node-0"]
    assert pool.num_used == 0 and pool.num_cached >= PREFIX_BLOCKS
    assert generate(cluster, PROMPTS[0]) == (before[0][0], PREFIX_BLOCKS * BLOCK_SIZE)

    drain(cluster)
    cluster.add_node("node-0", extra=("--block-size", str(2 * BLOCK_SIZE)))  # waits until READY
    log = cluster.child("node-0").log_tail(200)
    refusal = [line for line in log.splitlines() if "refused" in line]
    assert len(refusal) == 1 and refusal[0].endswith(
        "refused: it was taken with another configuration: "
        f"block_size {2 * BLOCK_SIZE} here, {BLOCK_SIZE} in the snapshot; starting cold")
    assert log.count("node node-0: restored ") == 1  # the first restart's only
    assert cached_prefix_blocks(cluster, 2 * BLOCK_SIZE) == 0
    tokens, cached = generate(cluster, PROMPTS[0])
    assert cached == 0 and len(tokens) == 8
