"""Triton paged decode attention: split-KV, GQA-grouped, with a reduction pass.

Pass 1, grid (batch, num_kv_heads, num_splits): a program takes the G = num_heads / num_kv_heads query
heads of one KV head as the rows of one tile, so each K/V tile is read once for the whole group, and
walks its split's tokens BLOCK_N at a time through the block table:

    token t ─▶ block_tables[b, t // block_size] ─▶ k_cache[block, kv_head, t % block_size, :]

It leaves unnormalised partial results: acc [batch, num_heads, num_splits, head_dim] and the running
max / sum (base 2) [batch, num_heads, num_splits, 2].
Pass 2, grid (batch, num_heads): merges the splits, divides by the sum. FP8 rows are widened times
their scales as they are loaded (``triton_tiles.load_kv_tile``).

With a sliding window (``window`` > 0) a split's range is clipped to the last ``window`` tokens; a
split wholly before them reads nothing (empty: it weighs nothing in pass 2). With a logit soft-cap
(``SOFTCAP``) a tile's scores are squashed, in their base-2 units, before the online softmax.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache, is_fp8
from kvfleet.kernels.triton_tiles import load_kv_tile, online_softmax_update, tile_scores

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, k_scale_ptr, v_scale_ptr,
    acc_ptr, ml_ptr,
    qk_scale, tokens_per_split, window, softcap,
    stride_qb, stride_qh,
    stride_cb, stride_ch, stride_co,
    stride_sb, stride_sh,
    stride_bt,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh, stride_ms,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, USE_FP32: tl.constexpr, IS_FP8: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(context_len, start + tokens_per_split)
    if window > 0:  # keys before context_len - window are out of the window: never read
        start = tl.maximum(start, context_len - window)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kv_head * GROUP + g
    # q: [BLOCK_G, BLOCK_D], with softmax scale and log2(e) folded in (exponentials are base 2)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * qk_scale

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_base = kv_head * stride_ch
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + b * stride_bt,
                            t, t_mask, head_base, d, d_mask, stride_cb, stride_co, kv_head * stride_sh, stride_sb,
                            BLOCK_SIZE, IS_FP8, USE_FP32)
        s = tile_scores(q, k, softcap, USE_FP32, SOFTCAP)  # [BLOCK_G, BLOCK_N]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m, l, acc = online_softmax_update(s, v, m, l, acc, USE_FP32)

    out = b * stride_ab + heads * stride_ah + split * stride_as
    tl.store(acc_ptr + out[:, None] + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])
    ml = b * stride_mb + heads * stride_mh + split * stride_ms
    tl.store(ml_ptr + ml, m, mask=g_mask)
    tl.store(ml_ptr + ml + 1, l, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr, ml_ptr, out_ptr,
    num_splits,
    stride_ab, stride_ah, stride_as,
    stride_mb, stride_mh, stride_ms,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = sp < num_splits
    base = b * stride_ab + head * stride_ah
    ml = b * stride_mb + head * stride_mh + sp * stride_ms
    m = tl.load(ml_ptr + ml, mask=s_mask, other=float("-inf"))
    l = tl.load(ml_ptr + ml + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(l > 0, tl.exp2(m - m_max), 0.0)  # empty splits (l == 0) weigh nothing
    total = tl.sum(w * l, 0)
    acc = tl.load(acc_ptr + base + sp[:, None] * stride_as + d[None, :],
                  mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def interpreting() -> bool:
    """Under the CPU interpreter: its bf16 arithmetic is wrong, so tiles are widened to fp32 there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(query: torch.Tensor, num_kv_heads: int, max_context: int) -> int:
    """Enough programs to fill the device twice over, none with fewer than 256 tokens."""
    num_sms = _num_sms(query.device.index or 0) if query.is_cuda else 2
    splits = 1
    while query.shape[0] * num_kv_heads * splits < 2 * num_sms and max_context // (2 * splits) >= 256:
        splits *= 2
    return splits


def tile_layout(query: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor) -> tuple[int, bool]:
    """What both attention launchers need of their inputs' layout, and derive from it: the GQA group
    size, and whether tiles take exact fp32 dots (fp32 caches, and the CPU interpreter, whose bf16
    arithmetic is wrong)."""
    # query: [rows, num_heads, head_dim], rows contiguous
    # cache.k, cache.v: [num_blocks, num_kv_heads, block_size, head_dim], rows contiguous, same strides
    # block_tables: [batch, max_blocks] int32, rows contiguous (AttentionMetadata checked the rest)
    assert query.stride(2) == 1 and block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    return query.shape[1] // cache.num_kv_heads, cache.k.dtype == torch.float32 or interpreting()


def _launch_decode(query, cache: LayerCache, meta: AttentionMetadata, params: AttentionParams, num_splits: int):
    # query: [batch, num_heads, head_dim]; decode_context_lens: [batch] int32
    batch, num_heads, head_dim = query.shape
    k_cache, v_cache, block_tables = cache.k, cache.v, meta.decode_block_tables
    num_kv_heads, block_size = cache.num_kv_heads, cache.block_size
    group, fp32 = tile_layout(query, cache, block_tables)

    # tokens_per_split: a multiple of BLOCK_N so that only the last tile of a split is ragged
    block_n = 64 if head_dim <= 128 else 32
    max_context = block_tables.shape[1] * block_size  # an upper bound, known without a device sync
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    acc = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    ml = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32, device=query.device)
    k_scale, v_scale = scale_pointers(cache)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, meta.decode_context_lens, k_scale, v_scale,
        acc, ml,
        params.scale * LOG2E, tokens_per_split, params.window or 0, (params.logit_softcap or 0.0) * LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1),
        block_tables.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, USE_FP32=fp32, IS_FP8=is_fp8(k_cache.dtype),
        SOFTCAP=params.logit_softcap is not None,
    )
    out = torch.empty_like(query)
    _decode_reduce_kernel[(batch, num_heads)](
        acc, ml, out,
        num_splits,
        acc.stride(0), acc.stride(1), acc.stride(2),
        ml.stride(0), ml.stride(1), ml.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
    )
    return out


def triton_paged_decode(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, params: AttentionParams,
                        num_splits: int | None = None) -> torch.Tensor:
    """Same contract as ``reference.paged_decode_reference``; ``num_splits`` None picks one per device."""
    if num_splits is None:
        num_splits = default_num_splits(query, cache.num_kv_heads, meta.decode_block_tables.shape[1] * cache.block_size)
    return _launch_decode(query.contiguous() if query.stride(2) != 1 else query, cache, meta, params, num_splits)


def scale_pointers(cache: LayerCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale caches a kernel reads (FP8), or a 3-D stand-in never read (other dtypes)."""
    if cache.k_scale is None:
        dummy = torch.empty(1, 1, 1, dtype=torch.float32, device=cache.k.device)
        return dummy, dummy
    return cache.k_scale, cache.v_scale
