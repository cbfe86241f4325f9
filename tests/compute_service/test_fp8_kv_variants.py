"""bench/fp8_kv_variants.py measures what it claims: its dense forward is the engine's model over a
paged pool, and its FP8 read-back is what the pool stores."""

from __future__ import annotations

import torch

from bench.fp8_accuracy import forward_all_positions
from bench.fp8_kv_variants import build, fp8_rows, int8_rows
from kvfleet.compute_service.kv.pool import allocate_kv_cache
from kvfleet.kernels.reference import quantize_kv
from tests.compute_service.conftest import random_prompt


def test_the_dense_forward_is_the_engine_model_over_a_float32_pool(llama_dir):
    model, mc, forward = build(llama_dir)
    prompts = [random_prompt(40, seed=s) for s in (1, 2)]
    pool = allocate_kv_cache(mc, 2 * 3, 16, torch.float32, torch.device("cpu"))
    paged = forward_all_positions(model, pool, prompts, 40)
    dense = forward(torch.tensor(prompts)).flatten(0, 1)
    assert (paged - dense).abs().max() < 1e-4


def test_the_fp8_read_back_is_the_pools():
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)
    stored, scale = quantize_kv(x, torch.float8_e4m3fn)
    torch.testing.assert_close(fp8_rows(x), stored.float() * scale[..., None], rtol=0, atol=0)
    # the int8 reference code is another code: uniform steps of amax / 127 per row
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((int8_rows(x) - x).abs() <= step / 2 + 1e-6).all())
    assert not torch.equal(int8_rows(x), fp8_rows(x))
