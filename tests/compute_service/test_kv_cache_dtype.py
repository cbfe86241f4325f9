"""The KV cache dtype: the bytes a block costs in each (scales included), the pool the engine
allocates matching that count, FP8 serving greedy tokens, and the refusals of bad names and of FP8
where the platform cannot hold it."""

from __future__ import annotations

import logging

import pytest
import torch

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.kv.cache_dtype import (
    KV_CACHE_DTYPES,
    fp8_unsupported_reason,
    kv_bytes_per_token,
    resolve_kv_cache_dtype,
)
from kvfleet.compute_service.kv.pool import allocate_kv_cache, bytes_per_block, kv_cache_dtype
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.conftest import random_prompt


def test_bytes_per_token_formula():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    assert kv_bytes_per_token(30, 3, 64, "float32") == 2 * 30 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(30, 3, 64, "bfloat16") == kv_bytes_per_token(30, 3, 64, "float16") == 23040
    # one byte per element plus one float32 scale per (token, KV head) row: 64 + 4 bytes a row
    assert kv_bytes_per_token(30, 3, 64, "fp8_e4m3") == 2 * 30 * 3 * (64 + 4) == 12240


def test_auto_is_the_model_dtype_and_unknown_names_are_refused():
    assert resolve_kv_cache_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_kv_cache_dtype("fp8_e4m3", "float32") == "fp8_e4m3"
    assert KV_CACHE_DTYPES == ("auto", "float32", "bfloat16", "float16", "fp8_e4m3")
    for bad in ("fp8", "float8_e4m3fn", "int8", ""):
        with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, float32, bfloat16, float16, fp8_e4m3"):
            resolve_kv_cache_dtype(bad, "float32")
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        EngineConfig(dtype="float32", kv_cache_dtype="fp4")


def test_fp8_platform_refusals():
    assert fp8_unsupported_reason(True, "cpu", None) is None
    assert fp8_unsupported_reason(True, "cuda", (9, 0)) is None
    assert fp8_unsupported_reason(True, "cuda", (8, 9)) is None
    assert "no float8_e4m3fn" in fp8_unsupported_reason(False, "cpu", None)
    assert "8.9 or later" in fp8_unsupported_reason(True, "cuda", (8, 0)) and "this one is 8.0" in \
        fp8_unsupported_reason(True, "cuda", (8, 0))


@pytest.mark.parametrize("name", ["float32", "bfloat16", "fp8_e4m3"])
def test_allocated_pool_matches_the_block_count(llama_dir, name):
    """What the pool really allocates per block (cache and scales) is what sizing and block_service
    registration count."""
    mc = ModelConfig.from_dir(llama_dir)
    dtype = kv_cache_dtype(name, "float32", torch.device("cpu"))
    cache, scales = allocate_kv_cache(mc, 3, 16, dtype, torch.device("cpu"))
    allocated = cache.nbytes + (0 if scales is None else scales.nbytes)
    assert (scales is not None) == (name == "fp8_e4m3")
    assert allocated == 3 * bytes_per_block(mc, 16, name) == 3 * bytes_per_block(mc, 16, dtype)


def test_fp8_engine_serves_and_fits_more_blocks(llama_dir, caplog):
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 130)]
    memory = 8 << 20
    blocks = {}
    tokens = {}
    for name in ("float32", "fp8_e4m3"):
        with caplog.at_level(logging.INFO, logger="kvfleet.compute_service.engine.llm_engine"):
            engine = LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=memory,
                                                        kv_cache_dtype=name))
        ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")][-1]
        assert f"KV cache {name}: " in ready and "B/token (float32 " in ready and "fp8_e4m3 " in ready
        blocks[name] = engine.allocator.num_blocks
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        tokens[name] = [o.new_token_ids for o in outs]
        assert engine.stats().blocks.num_used == 0
    assert all(len(t) == 12 for t in tokens["fp8_e4m3"])
    # a float32 row is 4 * head_dim bytes, an FP8 row head_dim + 4
    mc = ModelConfig.from_dir(llama_dir)
    assert blocks["fp8_e4m3"] == memory // bytes_per_block(mc, 16, "fp8_e4m3")
    assert blocks["fp8_e4m3"] >= 3 * blocks["float32"]
    # random weights: FP8 is not required to be token-identical, but mostly agrees (bench/fp8_accuracy.py
    # measures a real model)
    same = sum(a == b for f, q in zip(tokens["float32"], tokens["fp8_e4m3"]) for a, b in zip(f, q))
    assert same >= 18, tokens
