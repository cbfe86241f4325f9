"""FP8 keys stored centred (kv_centering.py): exact on a float32 pool, the centres average out the
RoPE pairs that rotate over the served positions, and an FP8 engine serves the same tokens through
the reference and the native CPU attention paths."""

from __future__ import annotations

import math

import pytest
import torch

from compute_service.engine import EngineConfig, LLMEngine
from compute_service.kv_centering import (
    CALIBRATION_TEXT,
    key_centers,
    mean_keys,
    rotation_average,
    set_key_centers,
    spread,
)
from compute_service.kv_pool import allocate_kv_cache
from compute_service.model_config import ModelConfig
from compute_service.tokenizer import Tokenizer
from compute_service.weights import load_model
from kernels import cpu_kernels
from kvfleet.sampling import SamplingParams
from tests.compute_service.conftest import random_prompt

BLOCK = 16


def _prefill(model, pool, prompt: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill of ``prompt`` over ``pool`` (blocks 0, 1, ...)."""
    from compute_service.attention_metadata import AttentionMetadata

    n = len(prompt)
    blocks = -(-n // BLOCK)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n), num_prefill_tokens=n,
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        prefill_context_lens=torch.tensor([n], dtype=torch.int32),
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int32), decode_context_lens=torch.zeros(0, dtype=torch.int32),
        scale=model.config.head_dim ** -0.5)
    with torch.inference_mode():
        return model(torch.tensor(prompt), torch.arange(n), pool[0], meta, torch.arange(n), pool[1])


@pytest.fixture(scope="module")
def model_and_config(llama_dir):
    mc = ModelConfig.from_dir(llama_dir)
    return load_model(llama_dir, mc, torch.float32, torch.device("cpu")), mc


def test_centred_keys_give_the_same_logits_on_a_float32_pool(llama_dir, model_and_config):
    model, mc = model_and_config
    prompt = random_prompt(70, seed=3)
    centres = key_centers(model, Tokenizer(llama_dir).encode(CALIBRATION_TEXT), mc.max_context_len)
    # a large common offset as well: exactness must not depend on the centre being small
    centres = centres + 3 * torch.randn(centres.shape, generator=torch.Generator().manual_seed(0))
    pools = [allocate_kv_cache(mc, 5, BLOCK, torch.float32, torch.device("cpu")) for _ in range(2)]
    set_key_centers(model, None)
    plain = _prefill(model, pools[0], prompt)
    set_key_centers(model, centres)
    try:
        centred = _prefill(model, pools[1], prompt)
    finally:
        set_key_centers(model, None)
    # the pool really holds other keys (every key minus its layer's and head's centre) ...
    keys = [pool[0][:, 0].permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :len(prompt)] for pool in pools]
    torch.testing.assert_close(keys[1], keys[0] - centres[:, :, None, :], atol=1e-5, rtol=1e-5)
    # ... and the logits are the same: softmax ignores the common shift -q.c of each query's logits
    assert (plain - centred).abs().max() < 1e-5 * max(1.0, float(plain.abs().max()))


def test_rotation_average_keeps_slow_pairs_and_cancels_fast_ones():
    inv_freq = torch.tensor([1.0, 1e-2, 1e-9])
    cos, sin = rotation_average(inv_freq, 8192)
    assert abs(float(cos[0])) < 0.01 and abs(float(sin[0])) < 0.01  # turns ~1300 times: averages out
    assert float(cos[2]) == pytest.approx(1.0, abs=1e-6)  # never turns: its offset is kept whole
    # spread rotates as apply_rope does: pair (x1, x2) -> (c x1 - s x2, s x1 + c x2)
    angle = 0.3
    x = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 0.5])  # pairs (1, 0), (0, 1), (2, .5)
    c, s = torch.full((3,), math.cos(angle)), torch.full((3,), math.sin(angle))
    out = spread(x, c, s)
    torch.testing.assert_close(out[[0, 3]], torch.tensor([math.cos(angle), math.sin(angle)]))
    torch.testing.assert_close(out[[1, 4]], torch.tensor([-math.sin(angle), math.cos(angle)]))


def test_centres_are_the_mean_key_averaged_over_the_served_positions(llama_dir, model_and_config):
    model, mc = model_and_config
    ids = Tokenizer(llama_dir).encode(CALIBRATION_TEXT)
    mean = mean_keys(model, ids)
    assert mean.shape == (mc.num_layers, mc.num_kv_heads, mc.head_dim)
    near = key_centers(model, ids, 1)  # one position: no pair turns, the centre is the mean key
    torch.testing.assert_close(near, mean.bfloat16().float())
    far = key_centers(model, ids, 1 << 20)
    half = mc.head_dim // 2
    # the fastest pair (inverse frequency 1) turns over and over: nothing of it is subtracted
    assert float(far[..., [0, half]].abs().max()) < 0.02 * float(mean[..., [0, half]].abs().max()) + 1e-6


@pytest.mark.skipif(not cpu_kernels.load_extension(), reason="native CPU kernel did not build")
def test_fp8_engine_is_token_identical_on_the_reference_and_native_paths(llama_dir, monkeypatch):
    """Centred FP8 keys through the native CPU store, decode and prefill and through the torch
    reference: the same greedy tokens (the kernels see only other key values)."""
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 130)]
    tokens = {}
    for path in ("reference", "native"):
        monkeypatch.setenv("KVFLEET_ATTENTION", "reference" if path == "reference" else "")
        engine = LLMEngine(llama_dir, EngineConfig(block_size=16, kv_cache_memory=8 << 20, kv_cache_dtype="fp8_e4m3"))
        outs = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        tokens[path] = [o.new_token_ids for o in outs]
        assert all(layer.self_attn.k_center is not None for layer in engine.runner.model.layers)
    assert tokens["reference"] == tokens["native"]
    assert all(len(t) == 12 for t in tokens["native"])
    # other dtypes store keys as computed
    plain = LLMEngine(llama_dir, EngineConfig(block_size=16, kv_cache_memory=8 << 20, kv_cache_dtype="bfloat16"))
    assert all(layer.self_attn.k_center is None for layer in plain.runner.model.layers)
