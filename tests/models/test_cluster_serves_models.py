"""Architectures and config features through a real 1-node cluster (etcd, block_service, a
compute node, the router): the same greedy tokens as transformers."""

from __future__ import annotations

import grpc
import pytest
import torch

from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.compute_service.kv.pool import bytes_per_block
from kvfleet.compute_service.model.config import ModelConfig
from tests.cluster.cluster_helpers import released_pool, request, stream, tokens_of
from tests.models.hf_models import build, prompt, reference_tokens

MAX_NEW = 8
NUM_BLOCKS = 12  # of 16 tokens: a 300-token prompt would not fit


def serve(model_dir, work_dir, prompts):
    pool = NUM_BLOCKS * bytes_per_block(ModelConfig.from_dir(model_dir), 16, torch.float32)
    with LocalCluster(model_dir, 1, work_dir=work_dir, block_size=16, kv_cache_memory=pool, dtype="float32") as cluster:
        got = [tokens_of(stream(cluster.router_address, request(tokens=p, max_tokens=MAX_NEW, ignore_eos=True)))
               for p in prompts]
        with pytest.raises(grpc.RpcError) as refused:
            stream(cluster.router_address, request(tokens=prompt(300, seed=3), max_tokens=MAX_NEW))
        pool = released_pool(cluster)
    return got, refused.value, pool


@pytest.mark.cluster
@pytest.mark.parametrize("case", ["qwen3_odd", "phi3_window", "gemma2_odd"])
def test_the_cluster_serves_what_transformers_computes(tmp_path, case):
    """One row per architecture feature set, each with tied embeddings: Qwen3 with attention biases,
    odd head shapes and a vocabulary (301) larger than its tokenizer's (260), so ids the model embeds
    are valid prompt tokens for the router; Phi-3 with fused checkpoints, partial RoPE and a sliding
    window; Gemma 2 with its sandwich norms, soft-caps, attention scale and alternating windows. A
    prompt longer than the context (256) is refused before block_service is asked for blocks it lacks."""
    model_dir = build(tmp_path / case, case)
    last_id = ModelConfig.from_dir(model_dir).vocab_size - 1
    prompts = [prompt(3, seed=1), prompt(100, seed=2) + [last_id]]
    got, refused, pool = serve(model_dir, tmp_path / "cluster", prompts)  # the pool once the requests are freed
    assert got == reference_tokens(model_dir, prompts, MAX_NEW)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len is 256" in refused.details()
    assert pool.counters.refusals_pool == 0, "the too-long prompt never asked block_service for blocks"
