"""The plan's arithmetic against cases computed by hand: a GQA model (Llama-3.1-8B) and an MLA model
(DeepSeek-V3), their parameter counts against the published totals, and the guide's own example."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvfleet.cli.planning.capacity import CapacityRequest, capacity
from kvfleet.cli.planning.devices import DEVICES
from kvfleet.cli.planning.shapes import PRESETS, ModelShape

GIB = 1 << 30
A100 = DEVICES["a100-80g"]


def test_gqa_kv_bytes_per_token_counts_layers_kv_heads_and_both_k_and_v():
    cap = capacity(PRESETS["llama-3.1-8b"], A100, CapacityRequest(context=131072))
    assert cap.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert cap.kv_formula == "2 x 32 layers x 8 kv_heads x 128 head_dim x 2 B = 131,072 B"
    assert cap.kv_bytes_per_token * 131072 == 16 * GIB  # one 128K sequence


def test_gqa_parameters_match_the_published_total():
    # embed and lm_head 128256 x 4096 each; per layer q, o 4096^2, k, v 4096 x 1024, MLP 3 x 4096 x 14336,
    # two norms; final norm
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert PRESETS["llama-3.1-8b"].num_params() == 2 * 128256 * 4096 + 32 * per_layer + 4096 == 8_030_261_248


def test_gqa_capacity_on_an_a100():
    cap = capacity(PRESETS["llama-3.1-8b"], A100, CapacityRequest(context=131072, block_size=256))
    reserve = GIB + 2048 * (4 * 4096 + 2 * 14336) * 2 + 256 * 128256 * 4
    assert cap.activation_reserve_bytes == reserve == 1_389_625_344
    assert cap.kv_budget_bytes == int(81920 * (1 << 20) * 0.9) - 8_030_261_248 * 2 - reserve == 59_859_263_488
    assert cap.block_bytes == 256 * 131_072
    assert cap.num_blocks == 59_859_263_488 // (256 * 131_072) == 1783
    assert (cap.blocks_per_seq, cap.last_block_waste_tokens, cap.max_concurrent_seqs) == (512, 0, 3)


def test_tensor_parallel_splits_kv_heads_and_weights_but_never_a_head():
    model = PRESETS["llama-3.1-70b"]
    tp4 = capacity(model, A100, CapacityRequest(context=8192, tensor_parallel=4))
    assert tp4.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2
    assert tp4.weights_bytes_per_device == -(-model.weights_bytes() // 4)
    tp16 = capacity(model, A100, CapacityRequest(context=8192, tensor_parallel=16))
    assert tp16.kv_bytes_per_token == 2 * 80 * 1 * 128 * 2  # 8 heads over 16 ranks: one replica each


def test_last_block_waste_and_blocks_per_sequence():
    cap = capacity(PRESETS["qwen2.5-7b"], A100, CapacityRequest(context=1000, block_size=256))
    assert (cap.blocks_per_seq, cap.last_block_waste_tokens) == (4, 24)
    assert cap.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344


def test_mla_kv_is_the_latent_plus_the_rope_key_without_a_factor_two():
    model = PRESETS["deepseek-v3"]
    cap = capacity(model, DEVICES["h200"], CapacityRequest(context=32768, tensor_parallel=8))
    assert cap.kv_bytes_per_token == 61 * (512 + 64) * 2 == 70_272  # replicated on every rank
    assert cap.kv_formula == "61 layers x (512 kv_lora_rank + 64 rope_dim) x 2 B = 70,272 B"
    fp8 = capacity(model, DEVICES["h200"], CapacityRequest(context=32768, kv_cache_dtype="fp8_e4m3"))
    assert fp8.kv_bytes_per_token == 61 * 576 == 35_136


def test_mla_moe_parameters_match_the_published_671b_and_37b_active():
    h = 7168
    attention = (h * 1536 + 1536 + 1536 * 128 * 192        # q: down, norm, up to 128 heads of 128 + 64
                 + h * 576 + 512 + 512 * 128 * 256          # kv: down to latent + rope key, norm, up to K_nope, V
                 + 128 * 128 * h)                           # o
    dense_mlp = 3 * h * 18432
    moe_mlp = 257 * 3 * h * 2048 + 256 * h                  # 256 routed + 1 shared expert, router
    total = 2 * 129280 * h + 61 * (attention + 2 * h) + 3 * dense_mlp + 58 * moe_mlp + h
    assert PRESETS["deepseek-v3"].num_params() == total == 671_026_404_352
    active = 2 * 129280 * h + 61 * (attention + 2 * h) + 3 * dense_mlp + 58 * (9 * 3 * h * 2048 + 256 * h) + h
    assert PRESETS["deepseek-v3"].num_params(active_only=True) == active
    assert active // 10**9 == 37  # 37.55B: the published "37B activated"
    assert PRESETS["deepseek-v3"].weights_bytes() == total  # FP8: one byte a weight


@pytest.mark.parametrize("name, billions", [("llama-3.1-70b", 70.6), ("qwen2.5-7b", 7.6), ("qwen2.5-72b", 72.7),
                                            ("mistral-7b", 7.2)])
def test_every_preset_matches_its_published_size(name, billions):
    assert round(PRESETS[name].num_params() / 1e9, 1) == billions


def test_the_guides_128k_example_corrected():
    """The guide: 1 x 131072 x 40 x 128 x 2 = "5.2 GB". The product is 1.34 GB; with a 40-layer,
    40-head model's layers and K and V it is 107 GB."""
    assert 131072 * 40 * 128 * 2 == 1_342_177_280
    model = ModelShape("40-layer MHA", 40, 5120, 13824, 40, 40, 128, 32000, 131072, dtype="float16")
    cap = capacity(model, A100, CapacityRequest(context=131072))
    assert cap.kv_bytes_per_token * 131072 == 2 * 40 * 40 * 128 * 2 * 131072 == 107_374_182_400


def test_kv_cache_memory_given_outright_skips_the_reserve():
    cap = capacity(PRESETS["mistral-7b"], A100, CapacityRequest(context=4096, kv_cache_memory=10 * GIB))
    assert cap.activation_reserve_bytes == 0 and cap.kv_budget_bytes == 10 * GIB
    assert cap.max_concurrent_seqs == 10 * GIB // (256 * 131_072) // 16 == 20


def test_a_model_that_does_not_fit_gets_no_blocks():
    cap = capacity(PRESETS["llama-3.1-70b"], A100, CapacityRequest(context=4096))
    assert cap.kv_budget_bytes < 0 and cap.num_blocks == 0 and cap.max_concurrent_seqs == 0


@pytest.mark.parametrize("field, value", [("context", 0), ("block_size", 24), ("kv_cache_dtype", "int4"),
                                          ("tensor_parallel", 0), ("gpu_memory_utilization", 1.5),
                                          ("kv_cache_memory", -1)])
def test_bad_requests_are_refused(field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        replace(CapacityRequest(context=10), **{field: value})
