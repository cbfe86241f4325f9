"""The native CPU decode kernel against float64 dense attention (the reference is checked the same way)."""

import pytest
import torch

import kernels
from kernels import cpu_decode
from kernels.testing import assert_close, dense_attention, make_case

pytestmark = pytest.mark.skipif(not cpu_decode.load_extension(), reason="native CPU kernel did not build")


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_dense(block_size, dtype):
    case = make_case([1, 17, 255, 1030], block_size=block_size, dtype=dtype, head_dim=64)
    assert_close(cpu_decode.cpu_paged_decode(*case.decode_args()), dense_attention(case))


@pytest.mark.parametrize("head_dim", [8, 40, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_head_dims_and_groups(head_dim, num_heads, num_kv_heads):
    case = make_case([3, 77, 300], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    assert_close(cpu_decode.cpu_paged_decode(*case.decode_args()), dense_attention(case))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_reduction(num_splits):
    # more splits than the short sequences have tokens: empty splits must not disturb the merge
    case = make_case([2, 40, 1500], block_size=32, head_dim=64)
    out = cpu_decode.cpu_paged_decode(*case.decode_args(), num_splits=num_splits)
    assert_close(out, dense_attention(case))


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache(query_dtype):
    case = make_case([33, 700], dtype=query_dtype, cache_dtype=torch.float8_e4m3fn, head_dim=64)
    assert_close(cpu_decode.cpu_paged_decode(*case.decode_args()), dense_attention(case))


def test_float32_matches_reference_tightly():
    # The engine's greedy tokens must equal transformers' in float32: no low-precision shortcut here.
    case = make_case([5, 513, 2049], num_heads=8, num_kv_heads=2, head_dim=128, block_size=16)
    out = cpu_decode.cpu_paged_decode(*case.decode_args())
    torch.testing.assert_close(out.double(), dense_attention(case), rtol=1e-5, atol=2e-6)


def test_views_of_the_pool_tensor():
    # The engine passes kv_cache[layer, 0] / kv_cache[layer, 1] of one [L, 2, ...] tensor.
    case = make_case([100, 31], block_size=16, head_dim=64)
    pool = torch.stack([torch.stack([case.v_cache, case.v_cache]), torch.stack([case.k_cache, case.v_cache])])
    args = list(case.decode_args())
    args[1], args[2] = pool[1, 0], pool[1, 1]
    assert_close(kernels.paged_decode(*args), dense_attention(case))


def test_dispatch_uses_native_kernel(monkeypatch):
    case = make_case([10, 20])
    calls = []
    real = cpu_decode.cpu_paged_decode
    monkeypatch.setattr(cpu_decode, "cpu_paged_decode", lambda *a: calls.append(1) or real(*a))
    kernels.paged_decode(*case.decode_args())
    assert calls == [1]
