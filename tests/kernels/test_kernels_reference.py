"""The torch references against float64 dense attention, and the dispatch in reference mode."""

import pytest
import torch

from kvfleet import kernels
from kvfleet.kernels import reference
from kvfleet.kernels.metadata import LayerCache
from kvfleet.kernels.testing import assert_close, dense_attention, make_case

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_reference(block_size, dtype):
    case = make_case([1, 17, 255, 1030], block_size=block_size, dtype=dtype)
    assert_close(reference.paged_decode_reference(*case.args()), dense_attention(case))


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reference(block_size, dtype):
    # Whole prompts (q_len == context), chunks after a cached prefix, and a single token.
    case = make_case([17, 300, 70, 1], q_lens=[17, 45, 1, 1], block_size=block_size, dtype=dtype)
    assert_close(reference.paged_prefill_reference(*case.args()), dense_attention(case))


def test_prefill_skips_empty_sequences():
    case = make_case([20, 33], q_lens=[0, 5])
    assert_close(reference.paged_prefill_reference(*case.args()), dense_attention(case))


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_gqa_groups(num_heads, num_kv_heads):
    case = make_case([40, 129], num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert_close(reference.paged_decode_reference(*case.args()), dense_attention(case))


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_with_per_token_scales(query_dtype):
    case = make_case([33, 300], dtype=query_dtype, cache_dtype=torch.float8_e4m3fn)
    assert case.cache.k.dtype == torch.float8_e4m3fn
    assert_close(reference.paged_decode_reference(*case.args()), dense_attention(case))
    prefill = make_case([33, 300], q_lens=[33, 7], dtype=query_dtype, cache_dtype=torch.float8_e4m3fn)
    assert_close(reference.paged_prefill_reference(*prefill.args()), dense_attention(prefill))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_store_kv_writes_slots_and_skips_padding(cache_dtype):
    num_blocks, num_kv_heads, block_size, head_dim = 4, 2, 16, 8
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.zeros(shape, dtype=cache_dtype)
    v_cache = torch.zeros(shape, dtype=cache_dtype)
    key = torch.randn(3, num_kv_heads, head_dim)
    value = torch.randn(3, num_kv_heads, head_dim)
    slots = torch.tensor([2 * block_size + 5, -1, 0])
    k_scale, v_scale = scale_caches(cache_dtype, shape)
    kernels.store_kv(key, value, LayerCache(k_cache, v_cache, k_scale, v_scale), slots)
    expect_k, expect_ks = reference.quantize_kv(key, cache_dtype)
    expect_v, expect_vs = reference.quantize_kv(value, cache_dtype)
    assert torch.equal(k_cache[2, :, 5].float(), expect_k[0].float())
    assert torch.equal(v_cache[0, :, 0].float(), expect_v[2].float())
    assert torch.count_nonzero(k_cache.float()) == torch.count_nonzero(expect_k[[0, 2]].float())
    if k_scale is not None:
        assert torch.equal(k_scale[2, :, 5], expect_ks[0]) and torch.equal(v_scale[0, :, 0], expect_vs[2])
        assert torch.count_nonzero(k_scale) == 2 * num_kv_heads  # the padding token wrote no scale


def scale_caches(cache_dtype, shape):
    if cache_dtype != torch.float8_e4m3fn:
        return None, None
    return torch.zeros(shape[:3]), torch.zeros(shape[:3])


def test_fp8_quantization_error_per_row():
    """Each row keeps e4m3's relative precision whatever its magnitude: |x - q·s| <= |x|/16 (3
    mantissa bits, round to nearest) + half the smallest subnormal step (2^-10 · s), with s the
    row's amax / 448. One shared scale would flush a row 1000× smaller than its neighbours to 0."""
    x = torch.randn(64, 2, 64) * torch.logspace(-3, 2, 64).view(64, 1, 1)
    q, s = reference.quantize_kv(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 2)
    err = (q.float() * s[..., None] - x).abs()
    assert bool((err <= x.abs() / 16 + s[..., None] * 2**-10).all())
    assert torch.equal(q.float().abs().amax(-1), torch.full((64, 2), 448.0))  # each row uses the whole range
    zero, zero_scale = reference.quantize_kv(torch.zeros(1, 1, 8), torch.float8_e4m3fn)
    assert not zero.float().isnan().any() and bool((zero_scale > 0).all())


def test_dispatch_reference_mode(monkeypatch):
    monkeypatch.setenv("KVFLEET_ATTENTION", "reference")
    case = make_case([5, 64], block_size=16)
    assert_close(kernels.paged_decode(*case.args()), dense_attention(case))
    prefill = make_case([5, 64], q_lens=[5, 3])
    assert_close(kernels.paged_prefill(*prefill.args()), dense_attention(prefill))


# Windows shorter than a block, equal to one, and across blocks without being a multiple of one; the
# case poisons every key older than the window (NaN, and released blocks leave the table).
WINDOWS = [5, 16, 24, 40]


@pytest.mark.parametrize("window", WINDOWS)
def test_sliding_window_reference(window):
    decode = make_case([1, 17, 40, 255], block_size=16, window=window)
    assert_close(reference.paged_decode_reference(*decode.args()), dense_attention(decode))
    prefill = make_case([17, 300, 70, 1, 90], q_lens=[17, 45, 1, 1, 90], block_size=16, window=window)
    assert_close(reference.paged_prefill_reference(*prefill.args()), dense_attention(prefill))


def test_sliding_window_changes_attention():
    """The window is honoured, not ignored: the same case without it gives other outputs."""
    case = make_case([100], block_size=16, window=24)
    full = make_case([100], block_size=16)
    assert not torch.allclose(dense_attention(case), dense_attention(full))
    assert_close(reference.paged_decode_reference(*full.args()), dense_attention(full))


@pytest.mark.parametrize("window", [5, 24])
def test_sliding_window_fp8_reference(window):
    """FP8 with its per-row scales through a window: poisoned scales of the keys outside it (NaN)
    must not be read either. The truth is attention over the dequantised cache, so the float32
    tolerance applies: quantisation error is bounded separately (test_fp8_quantization_error_per_row)."""
    fp8 = torch.float8_e4m3fn
    decode = make_case([1, 17, 40, 255], block_size=16, cache_dtype=fp8, window=window)
    assert_close(reference.paged_decode_reference(*decode.args()), dense_attention(decode))
    prefill = make_case([17, 300, 70, 1, 90], q_lens=[17, 45, 1, 1, 90], block_size=16, cache_dtype=fp8,
                        window=window)
    assert_close(reference.paged_prefill_reference(*prefill.args()), dense_attention(prefill))


def test_fp8_scales_are_required_and_per_row():
    """An FP8 cache without its scale caches, or with per-head scales, is refused (it would be read
    at the wrong magnitude); scales on another cache are refused too."""
    cache = make_case([20], cache_dtype=torch.float8_e4m3fn).cache
    with pytest.raises(ValueError, match="needs its k_scale and v_scale"):
        LayerCache(cache.k, cache.v)
    with pytest.raises(ValueError, match="scale per"):
        LayerCache(cache.k, cache.v, torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="FP8 caches only"):
        LayerCache(cache.k.float(), cache.v.float(), cache.k_scale, cache.v_scale)


# Soft-caps that bend the scores of these cases (scale·q·k ~ N(0, 1)) hard, with and without a window.
SOFTCAPS = [(0.5, None), (2.0, None), (2.0, 24)]


@pytest.mark.parametrize("logit_softcap,window", SOFTCAPS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_logit_softcap_reference(logit_softcap, window, cache_dtype):
    decode = make_case([1, 17, 40, 255], cache_dtype=cache_dtype, window=window, logit_softcap=logit_softcap)
    assert_close(reference.paged_decode_reference(*decode.args()), dense_attention(decode))
    prefill = make_case([17, 300, 70, 1, 90], q_lens=[17, 45, 1, 1, 90], cache_dtype=cache_dtype, window=window,
                        logit_softcap=logit_softcap)
    assert_close(reference.paged_prefill_reference(*prefill.args()), dense_attention(prefill))


def test_logit_softcap_changes_attention():
    """The cap is honoured, not ignored: without it the outputs differ."""
    capped = make_case([100], q_lens=[30], logit_softcap=0.5)
    plain = make_case([100], q_lens=[30])
    assert not torch.allclose(dense_attention(capped), dense_attention(plain), atol=1e-2)
    assert not torch.allclose(reference.paged_prefill_reference(*capped.args()),
                              reference.paged_prefill_reference(*plain.args()), atol=1e-2)


def test_dispatch_reference_mode_softcap(monkeypatch):
    monkeypatch.setenv("KVFLEET_ATTENTION", "reference")
    case = make_case([5, 64], logit_softcap=1.0)
    assert_close(kernels.paged_decode(*case.args()), dense_attention(case))
