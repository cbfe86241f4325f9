"""The CPU paths (native decode and store, GEMM prefill) against float64 dense attention."""

import pytest
import torch

from kvfleet import kernels
from kvfleet.kernels import cpu_kernels, cpu_prefill, reference
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache
from kvfleet.kernels.testing import assert_close, dense_attention, make_case

pytestmark = pytest.mark.skipif(not cpu_kernels.load_extension(), reason="native CPU kernel did not build")


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_dense(block_size, dtype):
    case = make_case([1, 17, 255, 1030], block_size=block_size, dtype=dtype, head_dim=64)
    assert_close(cpu_kernels.cpu_paged_decode(*case.args()), dense_attention(case))


@pytest.mark.parametrize("head_dim", [8, 40, 128, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_head_dims_and_groups(head_dim, num_heads, num_kv_heads):
    case = make_case([3, 77, 300], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    assert_close(cpu_kernels.cpu_paged_decode(*case.args()), dense_attention(case))


@pytest.mark.parametrize("head_dim", [40, 48, 128])  # widened rows; bf16 rows in place; vdpbf16ps where the CPU has it
def test_bf16_cache_head_dims(head_dim):
    case = make_case([3, 77, 300], num_heads=6, num_kv_heads=2, head_dim=head_dim, dtype=torch.bfloat16)
    assert_close(cpu_kernels.cpu_paged_decode(*case.args()), dense_attention(case))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_reduction(num_splits):
    # more splits than the short sequences have tokens: empty splits must not disturb the merge
    case = make_case([2, 40, 1500], block_size=32, head_dim=64)
    out = cpu_kernels.cpu_paged_decode(*case.args(), num_splits=num_splits)
    assert_close(out, dense_attention(case))


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache(query_dtype):
    case = make_case([33, 700], dtype=query_dtype, cache_dtype=torch.float8_e4m3fn, head_dim=64)
    assert_close(cpu_kernels.cpu_paged_decode(*case.args()), dense_attention(case))


def test_float32_matches_reference_tightly():
    # The engine's greedy tokens must equal transformers' in float32: no low-precision shortcut here.
    case = make_case([5, 513, 2049], num_heads=8, num_kv_heads=2, head_dim=128, block_size=16)
    out = cpu_kernels.cpu_paged_decode(*case.args())
    torch.testing.assert_close(out.double(), dense_attention(case), rtol=1e-5, atol=2e-6)


def test_views_of_the_pool_tensor():
    # The engine passes kv_cache[layer, 0] / kv_cache[layer, 1] of one [L, 2, ...] tensor.
    case = make_case([100, 31], block_size=16, head_dim=64)
    pool = torch.stack([torch.stack([case.cache.v, case.cache.v]), torch.stack([case.cache.k, case.cache.v])])
    cache = LayerCache(pool[1, 0], pool[1, 1])
    assert_close(kernels.paged_decode(case.query, cache, case.meta, case.params), dense_attention(case))


def test_dispatch_uses_native_kernel(monkeypatch):
    case = make_case([10, 20])
    calls = []
    real = cpu_kernels.cpu_paged_decode
    monkeypatch.setattr(cpu_kernels, "cpu_paged_decode", lambda *a: calls.append(1) or real(*a))
    kernels.paged_decode(*case.args())
    assert calls == [1]


def test_accepts_strided_query():
    case = make_case([50, 7], num_heads=8, num_kv_heads=2, head_dim=64)
    qkv = torch.cat([case.query, torch.zeros_like(case.query)], dim=2)  # query as a strided view
    assert_close(kernels.paged_decode(qkv[:, :, :64], case.cache, case.meta, case.params), dense_attention(case))


def test_native_op_rejects_bad_block_size():
    # the op checks its own arguments: it is callable as torch.ops.kvfleet_kernels.paged_decode_cpu
    k_cache = torch.zeros(2, 1, 8, 16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.kvfleet_kernels.paged_decode_cpu.default(
            torch.zeros(1, 1, 16), k_cache, k_cache, torch.zeros(1, 1, dtype=torch.int32),
            torch.ones(1, dtype=torch.int32), 1.0)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_store_matches_reference(cache_dtype):
    shape = (5, 2, 16, 40)  # [num_blocks, num_kv_heads, block_size, head_dim]
    caches = [torch.zeros(shape, dtype=cache_dtype) for _ in range(4)]
    key, value = torch.randn(6, 2, 40), torch.randn(6, 2, 40)
    slots = torch.tensor([0, 17, -1, 79, 33, 2])
    scales = [torch.zeros(shape[:3]) for _ in range(4)] if cache_dtype == torch.float8_e4m3fn else [None] * 4
    cpu_kernels.cpu_store_kv(key, value, LayerCache(caches[0], caches[1], scales[0], scales[1]), slots)
    reference.store_kv_reference(key, value, LayerCache(caches[2], caches[3], scales[2], scales[3]), slots)
    for got, want in zip(caches[:2] + scales[:2], caches[2:] + scales[2:]):
        assert got is want is None or torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_store_rejects_slot_outside_pool():
    k_cache = torch.zeros(2, 1, 16, 8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.store_kv(torch.ones(1, 1, 8), torch.ones(1, 1, 8), LayerCache(k_cache, k_cache.clone()),
                         torch.tensor([32]))
    assert not k_cache.any()


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_matches_dense(block_size, dtype):
    # whole prompts, a chunk after a cached prefix, single tokens, an empty sequence
    case = make_case([17, 300, 1030, 1, 9], q_lens=[17, 45, 100, 1, 0], block_size=block_size, dtype=dtype,
                     num_heads=8, num_kv_heads=2)
    assert_close(kernels.paged_prefill(*case.args()), dense_attention(case))


def test_prefill_in_row_chunks(monkeypatch):
    monkeypatch.setattr(cpu_prefill, "SCORE_BUDGET", 1)  # 16 rows per chunk
    monkeypatch.setattr(cpu_kernels, "supports_prefill", lambda query, cache: False)  # the GEMMs, not the native kernel
    case = make_case([300, 70], q_lens=[120, 70], num_heads=8, num_kv_heads=2)
    out = cpu_prefill.cpu_paged_prefill(*case.args())
    torch.testing.assert_close(out.double(), dense_attention(case), rtol=1e-5, atol=2e-6)


def test_prefill_fp8_cache():
    case = make_case([33, 200], q_lens=[33, 20], cache_dtype=torch.float8_e4m3fn)
    assert_close(kernels.paged_prefill(*case.args()), dense_attention(case))


@pytest.mark.parametrize("window", [5, 16, 24, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_decode_and_prefill(window, dtype):
    decode = make_case([1, 17, 40, 255, 1030], block_size=16, dtype=dtype, head_dim=64, window=window)
    assert_close(cpu_kernels.cpu_paged_decode(*decode.args()), dense_attention(decode))
    assert_close(kernels.paged_decode(*decode.args()), dense_attention(decode))
    prefill = make_case([17, 300, 70, 1, 90], q_lens=[17, 45, 1, 1, 90], block_size=16, dtype=dtype,
                        window=window)
    assert_close(kernels.paged_prefill(*prefill.args()), dense_attention(prefill))


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_sliding_window_split_kv(num_splits):
    case = make_case([2, 40, 1500], block_size=32, head_dim=64, window=600)
    out = cpu_kernels.cpu_paged_decode(*case.args(), num_splits=num_splits)
    assert_close(out, dense_attention(case))


def test_sliding_window_prefill_row_chunks(monkeypatch):
    """Long chunks are taken in row chunks: each chunk starts its keys at its own first row's window."""
    monkeypatch.setattr(cpu_prefill, "SCORE_BUDGET", 1)  # 16 rows per chunk
    case = make_case([300, 70], q_lens=[120, 70], num_heads=8, num_kv_heads=2, window=40)
    assert_close(cpu_prefill.cpu_paged_prefill(*case.args()), dense_attention(case))


@pytest.mark.parametrize("window", [5, 24, 600])
def test_sliding_window_fp8(window):
    """FP8 rows times their own scales, through a window, split or not; prefill too. Against the
    dequantised cache (float32 tolerance: quantisation error is not the kernel's)."""
    case = make_case([1, 17, 40, 1500], block_size=32, head_dim=64, cache_dtype=torch.float8_e4m3fn, window=window)
    for num_splits in (0, 3):
        assert_close(cpu_kernels.cpu_paged_decode(*case.args(), num_splits=num_splits), dense_attention(case))
    prefill = make_case([17, 300, 90], q_lens=[17, 45, 90], cache_dtype=torch.float8_e4m3fn, window=window)
    assert_close(kernels.paged_prefill(*prefill.args()), dense_attention(prefill))


def test_fp8_kernel_refuses_per_head_scales():
    case = make_case([20], cache_dtype=torch.float8_e4m3fn)
    cache, meta = case.cache, case.meta
    with pytest.raises(RuntimeError, match="scale per"):
        torch.ops.kvfleet_kernels.paged_decode_cpu.default(
            case.query, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, 1.0,
            torch.ones(2), torch.ones(2))


# Soft-caps that bend the scores of these cases (scale·q·k ~ N(0, 1)) hard, with and without a window.
SOFTCAPS = [(0.5, None), (2.0, None), (2.0, 40)]
SOFTCAP_DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.float8_e4m3fn)]


@pytest.mark.parametrize("logit_softcap,window", SOFTCAPS)
@pytest.mark.parametrize("dtype,cache_dtype", SOFTCAP_DTYPES)
def test_logit_softcap_decode(logit_softcap, window, dtype, cache_dtype):
    case = make_case([1, 17, 255, 1030], dtype=dtype, cache_dtype=cache_dtype, head_dim=64, window=window,
                     logit_softcap=logit_softcap)
    for num_splits in (0, 3):  # the merge of splits sees capped maxima
        assert_close(cpu_kernels.cpu_paged_decode(*case.args(), num_splits=num_splits), dense_attention(case))
    assert_close(kernels.paged_decode(*case.args()), dense_attention(case))


@pytest.mark.parametrize("logit_softcap,window", SOFTCAPS)
@pytest.mark.parametrize("dtype,cache_dtype", SOFTCAP_DTYPES)
def test_logit_softcap_prefill(logit_softcap, window, dtype, cache_dtype, monkeypatch):
    # whole prompts (which take torch's fused kernel when uncapped), chunks after a prefix, row chunks
    monkeypatch.setattr(cpu_prefill, "SCORE_BUDGET", 1)  # 16 rows per chunk
    case = make_case([17, 300, 70, 1], q_lens=[17, 45, 70, 1], dtype=dtype, cache_dtype=cache_dtype, num_heads=8,
                     window=window, logit_softcap=logit_softcap)
    assert_close(kernels.paged_prefill(*case.args()), dense_attention(case))


def test_native_softcap_matches_tanh_in_float32_tightly():
    case = make_case([5, 513, 2049], num_heads=8, num_kv_heads=2, head_dim=128, logit_softcap=1.0)
    out = cpu_kernels.cpu_paged_decode(*case.args())
    torch.testing.assert_close(out.double(), dense_attention(case), rtol=1e-5, atol=2e-6)


def test_int64_tables_are_refused_where_built():
    case = make_case([50, 7])
    with pytest.raises(ValueError, match="decode_block_tables must be int32"):
        AttentionMetadata.decode_only(case.meta.decode_block_tables.long(), case.meta.decode_context_lens)
    with pytest.raises(ValueError, match="logit_softcap must be positive"):
        AttentionParams(1.0, logit_softcap=0.0)
