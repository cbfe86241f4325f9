"""Cases for the Triton kernels against float64 dense attention.

Not collected by a plain ``pytest`` run (the name does not start with ``test_``): the interpreter must be
on before triton itself is imported, so ``test_kernels_triton.py`` runs this file in a child process with
``TRITON_INTERPRET=1`` on CPU tensors. ``bench/gpu_kernels.sh`` runs it on a GPU with
``KVFLEET_TRITON_DEVICE=cuda``.
"""

import os

import pytest
import torch

from kvfleet.kernels import reference
from kvfleet.kernels.metadata import LayerCache
from kvfleet.kernels.testing import assert_close, dense_attention, make_case

DEVICE = os.environ.get("KVFLEET_TRITON_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_kernels_triton.py (needs TRITON_INTERPRET=1 from the start)",
                allow_module_level=True)

from kvfleet.kernels.triton_decode import triton_paged_decode  # noqa: E402
from kvfleet.kernels.triton_prefill import triton_paged_prefill  # noqa: E402
from kvfleet.kernels.triton_store import triton_store_kv  # noqa: E402

ODD_LENGTHS = [1, 17, 255, 1030]


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_decode_odd_lengths(block_size):
    case = make_case(ODD_LENGTHS, block_size=block_size, num_heads=8, num_kv_heads=2, device=DEVICE)
    assert_close(triton_paged_decode(*case.args()), dense_attention(case))


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_kv(num_splits):
    # more splits than the short sequences have tokens: empty splits must weigh nothing
    case = make_case([2, 40, 1500], block_size=32, device=DEVICE)
    assert_close(triton_paged_decode(*case.args(), num_splits=num_splits), dense_attention(case))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(dtype):
    case = make_case([17, 300], block_size=16, dtype=dtype, num_heads=8, num_kv_heads=2, device=DEVICE)
    assert_close(triton_paged_decode(*case.args()), dense_attention(case))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 40), (6, 1, 64), (32, 8, 128)])
def test_decode_groups_and_head_dims(num_heads, num_kv_heads, head_dim):
    case = make_case([33, 129], num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     device=DEVICE)
    assert_close(triton_paged_decode(*case.args()), dense_attention(case))


def test_decode_fp8_cache():
    case = make_case([17, 300], cache_dtype=torch.float8_e4m3fn, device=DEVICE)
    assert_close(triton_paged_decode(*case.args()), dense_attention(case))


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_prefill_odd_lengths(block_size):
    # whole prompts (q_len == context), a chunk after a cached prefix, a single new token
    case = make_case([17, 255, 1030, 1], q_lens=[17, 100, 45, 1], block_size=block_size,
                     num_heads=8, num_kv_heads=2, device=DEVICE)
    assert_close(triton_paged_prefill(*case.args()), dense_attention(case))


def test_prefill_empty_sequence_and_head_dim_40():
    case = make_case([20, 70], q_lens=[0, 70], head_dim=40, device=DEVICE)
    assert_close(triton_paged_prefill(*case.args()), dense_attention(case))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_prefill_low_precision_cache(cache_dtype):
    dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float32
    case = make_case([40, 90], q_lens=[40, 9], dtype=dtype, cache_dtype=cache_dtype, device=DEVICE)
    assert_close(triton_paged_prefill(*case.args()), dense_attention(case))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_store_matches_reference(cache_dtype):
    num_blocks, num_kv_heads, block_size, head_dim = 5, 2, 16, 40
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    key = torch.randn(6, num_kv_heads, head_dim, device=DEVICE)
    value = torch.randn(6, num_kv_heads, head_dim, device=DEVICE)
    slots = torch.tensor([0, 17, -1, 79, 33, 2], device=DEVICE)
    scales = [None] * 4
    if cache_dtype == torch.float8_e4m3fn:
        scales = [torch.zeros(shape[:3], device=DEVICE) for _ in range(4)]
    triton_store_kv(key, value, LayerCache(caches[0], caches[1], scales[0], scales[1]), slots)
    reference.store_kv_reference(key, value, LayerCache(caches[2], caches[3], scales[2], scales[3]), slots)
    for got, want in zip(caches[:2] + scales[:2], caches[2:] + scales[2:]):
        assert got is want is None or torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("window", [5, 16, 24, 40])
def test_sliding_window(window):
    decode = make_case([1, 17, 40, 130], block_size=16, num_heads=4, num_kv_heads=2, device=DEVICE,
                       window=window)
    assert_close(triton_paged_decode(*decode.args()), dense_attention(decode))
    assert_close(triton_paged_decode(*decode.args(), num_splits=3), dense_attention(decode))
    prefill = make_case([17, 150, 70, 1], q_lens=[17, 45, 1, 1], block_size=16, num_heads=4, num_kv_heads=2,
                        device=DEVICE, window=window)
    assert_close(triton_paged_prefill(*prefill.args()), dense_attention(prefill))


@pytest.mark.parametrize("window", [5, 24])
def test_sliding_window_fp8(window):
    fp8 = torch.float8_e4m3fn
    decode = make_case([1, 17, 40, 130], block_size=16, cache_dtype=fp8, device=DEVICE, window=window)
    assert_close(triton_paged_decode(*decode.args()), dense_attention(decode))
    assert_close(triton_paged_decode(*decode.args(), num_splits=3), dense_attention(decode))
    prefill = make_case([17, 150, 70, 1], q_lens=[17, 45, 1, 1], block_size=16, cache_dtype=fp8, device=DEVICE,
                        window=window)
    assert_close(triton_paged_prefill(*prefill.args()), dense_attention(prefill))


# Soft-caps that bend the scores of these cases (scale·q·k ~ N(0, 1)) hard; float32 under the
# interpreter (its bf16 arithmetic is wrong), FP8 caches widened to float32 there too.
@pytest.mark.parametrize("logit_softcap,window", [(0.5, None), (2.0, None), (2.0, 24)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_logit_softcap(logit_softcap, window, cache_dtype):
    decode = make_case([1, 17, 40, 300], block_size=16, cache_dtype=cache_dtype, device=DEVICE, window=window,
                       logit_softcap=logit_softcap)
    assert_close(triton_paged_decode(*decode.args()), dense_attention(decode))
    assert_close(triton_paged_decode(*decode.args(), num_splits=3), dense_attention(decode))
    prefill = make_case([17, 150, 70, 1], q_lens=[17, 45, 70, 1], block_size=16, cache_dtype=cache_dtype,
                        device=DEVICE, window=window, logit_softcap=logit_softcap)
    assert_close(triton_paged_prefill(*prefill.args()), dense_attention(prefill))
