"""``kvfleet compute --kv-host-memory --kv-disk-dir`` in a one-node cluster (router -> node ->
block_service): a prompt whose blocks were evicted from the node's pool comes back promoted from
the host and disk tiers (reported as cached tokens, not recomputed), with the tokens of the
in-process engine without tiers."""

from __future__ import annotations

from cluster_helpers import BLOCK_SIZE, random_prompt, request, stream, tokens_of

from compute_service.engine import EngineConfig, LLMEngine
from compute_service.kv_pool import bytes_per_block
from compute_service.model_config import ModelConfig
from kvfleet.sampling import SamplingParams

PROMPT = random_prompt(64, 41)                         # 3 reusable blocks
OTHERS = [random_prompt(160, 50 + i) for i in range(3)]  # each fills most of a 14-block pool


def test_evicted_prefix_is_promoted_from_host_and_disk_through_the_cluster(start_cluster, model_dir, tmp_path):
    per_block = bytes_per_block(ModelConfig.from_dir(model_dir), BLOCK_SIZE, "float32")
    expected = LLMEngine(model_dir, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=16 << 20)).generate(
        [PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].new_token_ids
    cluster = start_cluster(1, kv_cache_memory=14 * per_block,
                            compute_args=("--kv-host-memory", str(2 * per_block)),
                            kv_disk=(tmp_path / "kv", 64 * per_block))
    first = stream(cluster.router_address, request(tokens=PROMPT, max_tokens=8, ignore_eos=True))
    assert tokens_of(first) == expected
    for other in OTHERS:
        stream(cluster.router_address, request(tokens=other, max_tokens=4, ignore_eos=True))
    again = stream(cluster.router_address, request(tokens=PROMPT, max_tokens=8, ignore_eos=True))
    assert tokens_of(again) == expected
    assert again[-1].usage.cached_tokens == 3 * BLOCK_SIZE  # promoted from host/disk, not recomputed
    assert any((tmp_path / "kv" / "node-0").iterdir())     # the node's own disk directory was used
