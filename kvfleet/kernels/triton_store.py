"""Triton KV store: write new tokens' K/V at their slots of the paged cache (GPU; CPU tests interpret it).

    key/value [num_tokens, num_kv_heads, head_dim] ──slot_mapping──▶ cache[slot // bs, head, slot % bs, :]

One program per (token, kv head) copies one head_dim row of K and one of V. FP8 caches are quantised in
torch first (x / its row's scale, the scales written to the scale caches), so the kernel only ever
moves bytes of the cache's own type.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.metadata import LayerCache, is_fp8
from kvfleet.kernels.reference import prepare_store


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_co,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    d = tl.arange(0, BLOCK_D)
    mask = d < HEAD_DIM
    dst = (slot // BLOCK_SIZE) * stride_cb + head * stride_ch + (slot % BLOCK_SIZE) * stride_co + d
    k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def _launch_store(key, value, k_cache, v_cache, slot_mapping):
    # key, value: [num_tokens, num_kv_heads, head_dim], rows contiguous, in the cache's dtype
    # k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], rows contiguous, same strides (LayerCache)
    num_tokens, num_kv_heads, head_dim = key.shape
    assert key.dtype == value.dtype == k_cache.dtype and key.stride(2) == 1 and value.stride(2) == 1
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.is_contiguous()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[2], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
    )


def triton_store_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """Same contract as ``reference.store_kv_reference``; negative slots are skipped."""
    key, value = prepare_store(key, value, cache, slot_mapping)
    k_cache, v_cache = cache.k, cache.v
    if is_fp8(k_cache.dtype):  # move FP8 as bytes: no float8 arithmetic in the kernel
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _launch_store(key, value, k_cache, v_cache, slot_mapping.contiguous())
