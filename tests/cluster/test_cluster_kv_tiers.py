"""``kvfleet compute --kv-host-memory --kv-disk-dir`` in a one-node cluster (router -> node ->
block_service): a prompt whose blocks were evicted from the node's pool comes back promoted from
the host and disk tiers (reported as cached tokens, not recomputed), with the tokens of the
in-process engine without tiers."""

from __future__ import annotations

import time
import urllib.request

from cluster_helpers import BLOCK_SIZE, block_pools, random_prompt, request, stream, tokens_of

from kvfleet.cli.local_nodes import local_node_settings
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.kv.pool import bytes_per_block
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.core.sampling import SamplingParams

PROMPT = random_prompt(64, 41)                         # 3 reusable blocks
OTHERS = [random_prompt(160, 50 + i) for i in range(3)]  # each fills most of a 14-block pool


def node_lower_tiers(cluster) -> dict[str, int]:
    """What the node says it holds below its pool (its ``kvfleet:kv_tier_blocks`` gauge), by tier."""
    text = urllib.request.urlopen(cluster.metrics_urls["node-0"], timeout=10).read().decode()
    held = {}
    for line in text.splitlines():
        if line.startswith("kvfleet:kv_tier_blocks{"):
            tier = line.split('tier="')[1].split('"')[0]
            if tier in ("host", "disk"):
                held[tier] = int(float(line.rsplit(" ", 1)[1]))
    return held


def tiers_in_step(cluster) -> dict[str, int]:
    """The node's lower tiers once block_service's record of them says the same (moves are sent with
    the step's bookkeeping, so they may trail the node by a flush)."""
    deadline = time.monotonic() + 30
    while True:
        node = node_lower_tiers(cluster)
        recorded = {tier: n for tier, n in block_pools(cluster)["node-0"].lower_tier.items()}
        if {t: n for t, n in node.items() if n} == {t: n for t, n in recorded.items() if n}:
            return node
        assert time.monotonic() < deadline, f"block_service records {recorded}, the node holds {node}"
        time.sleep(0.2)


def test_evicted_prefix_is_promoted_from_host_and_disk_through_the_cluster(start_cluster, model_dir, tmp_path):
    per_block = bytes_per_block(ModelConfig.from_dir(model_dir), BLOCK_SIZE, "float32")
    expected = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=16 << 20)).generate(
        [PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].new_token_ids
    tiers = local_node_settings(kv_host_memory=2 * per_block, kv_disk_dir=str(tmp_path / "kv"),
                                kv_disk_bytes=64 * per_block)
    cluster = start_cluster(1, kv_cache_memory=14 * per_block, node=tiers)
    first = stream(cluster.router_address, request(tokens=PROMPT, max_tokens=8, ignore_eos=True))
    assert tokens_of(first) == expected
    for other in OTHERS:
        stream(cluster.router_address, request(tokens=other, max_tokens=4, ignore_eos=True))
    demoted = tiers_in_step(cluster)
    assert sum(demoted.values()) >= 3  # the prompt's blocks at least, known to block_service per tier
    again = stream(cluster.router_address, request(tokens=PROMPT, max_tokens=8, ignore_eos=True))
    assert tokens_of(again) == expected
    assert again[-1].usage.cached_tokens == 3 * BLOCK_SIZE  # promoted from host/disk, not recomputed
    assert any((tmp_path / "kv" / "node-0").iterdir())     # the node's own disk directory was used
    promoted = tiers_in_step(cluster)                      # the promoted blocks left the lower tiers
    assert sum(promoted.values()) < sum(demoted.values()) + 2 * 14
