"""The fused per-layer CPU ops (``kvfleet/kernels/csrc/fused_cpu.cpp``) against the torch ops they replace."""

import pytest
import torch

from kvfleet.compute_service.model.causal_lm import RMSNorm
from kvfleet.compute_service.model.rope import apply_rope
from kvfleet.kernels import cpu_kernels, reference
from kvfleet.kernels.metadata import LayerCache

pytestmark = pytest.mark.skipif(not cpu_kernels.load_extension(), reason="native CPU kernel did not build")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_add_rms_norm_matches_torch(dtype, rows):
    torch.manual_seed(rows)
    x, h = torch.randn(rows, 576).to(dtype) * 3, torch.randn(rows, 576).to(dtype)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576).to(dtype)
    want_x = x + h
    want = norm(want_x)
    out = cpu_kernels.add_rms_norm(x, h, norm.weight.data, norm.eps)
    assert torch.equal(x, want_x)  # the residual is updated in place, rounded as torch's add
    if dtype == torch.float32:  # only the order of the sum of squares differs
        torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    else:  # a sum order's last bit may move a rounding of the 16-bit result by one step
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (out == want).float().mean() > 0.99
    assert torch.equal(cpu_kernels.add_rms_norm(want_x.clone(), None, norm.weight.data, norm.eps), out)


@pytest.mark.parametrize("dim", [64, 40, 128])  # float32: 16-lane vectors where half the dim allows, else scalar
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_matches_torch(dtype, dim):
    torch.manual_seed(0)
    tokens, heads, kv_heads, block_size = 37, 9, 3, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)  # q, k, v: strided views, as the model has them
    q, k, v = (t.view(tokens, -1, dim) for t in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
    angles = torch.randn(tokens, dim // 2) * 10
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    want_q, want_k = apply_rope(q, k, cos[:, None], sin[:, None])
    slots = torch.randperm(4 * block_size)[:tokens]
    slots[5] = -1  # padding: turned q, nothing stored
    shape = (4, kv_heads, block_size, dim)
    want_cache = LayerCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    reference.store_kv_reference(want_k, v, want_cache, slots)
    cache = LayerCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    cpu_kernels.rope_store(q, k, v, cos, sin, cache, slots)
    assert torch.equal(q, want_q)  # bit for bit: every product and sum rounded where torch rounds
    assert torch.equal(cache.k, want_cache.k) and torch.equal(cache.v, want_cache.v)


def test_rope_store_refuses_a_slot_past_the_pool():
    q, k = torch.zeros(1, 2, 8), torch.zeros(1, 1, 8)
    cache = LayerCache(torch.zeros(1, 1, 16, 8), torch.zeros(1, 1, 16, 8))
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_kernels.rope_store(q, k, k, torch.ones(1, 8), torch.zeros(1, 8), cache, torch.tensor([16]))
