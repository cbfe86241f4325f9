"""A 16K-token prompt through a real cluster (etcd, block_service, a node, the router) on the long
preset (131,072 positions, llama3 RoPE, strong random weights), with FP8 and with float32 KV: the
cluster's greedy tokens are the in-process engine's, and with float32 KV transformers' too. The
prompt prefills in 8 chunks of 2048 tokens into 16 blocks of 1024; a prompt as long as the model's
positions is refused before any work. ``bench/long_context.py`` sends the full 131,072."""

from __future__ import annotations

import grpc
import pytest
import torch
from cluster_helpers import random_prompt, request, stream, tokens_of

from kvfleet.cli.model_maker import make_model

PROMPT_TOKENS = 16384
MAX_TOKENS = 8
BLOCK_SIZE = 1024
POOL = 24 << 20  # float32: 1 KiB a token, 16K + 8 tokens in 17 blocks of 1 MiB; FP8 fits ~4x more
PROMPT = random_prompt(PROMPT_TOKENS, seed=16)


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("long-model") / "long", "long", seed=0)


@pytest.fixture
def model_dir(long_dir):
    """``start_cluster`` serves the long model in this module (not the session's tiny one)."""
    return long_dir


@pytest.fixture(scope="module")
def in_process(long_dir) -> dict[str, list[int]]:
    """The in-process engine's greedy tokens, by KV dtype, with the node's block size and pool."""
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.sampling import SamplingParams

    tokens = {}
    for dtype in ("fp8_e4m3", "float32"):
        engine = LLMEngine(long_dir, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=POOL,
                                                        kv_cache_dtype=dtype))
        [out] = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        tokens[dtype] = out.new_token_ids
    assert tokens["fp8_e4m3"] != tokens["float32"]  # the model is sensitive enough to show FP8's rounding
    return tokens


@torch.inference_mode()
def transformers_greedy(model_dir, prompt: list[int]) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "float32"])
def test_a_16k_prompt_through_the_cluster_is_token_exact(start_cluster, long_dir, in_process, kv_cache_dtype):
    cluster = start_cluster(num_nodes=1, block_size=BLOCK_SIZE, kv_cache_memory=POOL, kv_cache_dtype=kv_cache_dtype,
                            http=False, metrics=False)
    chunks = stream(cluster.router_address, request(tokens=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True),
                    timeout=600)
    assert tokens_of(chunks) == in_process[kv_cache_dtype]
    assert chunks[-1].usage.prompt_tokens == PROMPT_TOKENS
    if kv_cache_dtype == "float32":
        assert tokens_of(chunks) == transformers_greedy(long_dir, PROMPT)
    with pytest.raises(grpc.RpcError) as info:  # as long as the positions: no room for a token
        stream(cluster.router_address, request(tokens=random_prompt(131072, seed=1), max_tokens=1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_model_len is 131072" in info.value.details()
