"""Triton paged prefill attention: packed new tokens over their cached prefix and themselves, causal.

Grid (batch, num_kv_heads, row tiles). The rows of a tile are (new token, query head of the group)
pairs, so each K/V tile is read once for the whole GQA group:

    row r ─▶ token i = r // G, head kv_head * G + r % G, position ctx - q_len + i

Sequence b's new tokens are rows ``query_start_loc[b]:query_start_loc[b+1]`` of the packed query and the
last ``q_len`` of its ``context_lens[b]`` positions; row r sees keys ``0..position`` (its K/V, like the
whole prefix, is already in the cache), so a tile walks keys only up to its last row's position.
With a sliding window (``window`` > 0) row r also drops keys ``<= position - window``, and a tile
starts at the oldest key its first row sees: older keys and their block-table entries are never read.
Soft-capped scores (``SOFTCAP``) are squashed before the mask, as in ``triton_decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache, is_fp8
from kvfleet.kernels.triton_decode import LOG2E, scale_pointers, tile_layout
from kvfleet.kernels.triton_tiles import load_kv_tile, online_softmax_update, tile_scores


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    k_scale_ptr, v_scale_ptr, out_ptr,
    qk_scale, window, softcap,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ch, stride_co,
    stride_sb, stride_sh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_FP32: tl.constexpr, IS_FP8: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    context_len = tl.load(context_lens_ptr + b)
    row0 = tile * BLOCK_M
    if row0 >= q_len * GROUP:
        return

    r = row0 + tl.arange(0, BLOCK_M)
    i = r // GROUP
    heads = kv_head * GROUP + r % GROUP
    r_mask = i < q_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    pos = context_len - q_len + i  # [BLOCK_M]
    q = tl.load(q_ptr + (q_start + i)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    q = q * qk_scale

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    last_row = tl.minimum(row0 + BLOCK_M, q_len * GROUP) - 1
    kv_end = context_len - q_len + last_row // GROUP + 1  # keys past the tile's last position are masked
    # the oldest key the tile's first row sees (0 without a window)
    kv_start = tl.where(window > 0, tl.maximum(context_len - q_len + row0 // GROUP - window + 1, 0), 0)
    head_base = kv_head * stride_ch
    for t0 in range(kv_start, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_mask = t < kv_end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr + b * stride_bt,
                            t, t_mask, head_base, d, d_mask, stride_cb, stride_co, kv_head * stride_sh, stride_sb,
                            BLOCK_SIZE, IS_FP8, USE_FP32)
        causal = t_mask[None, :] & (t[None, :] <= pos[:, None])
        if window > 0:
            causal = causal & (t[None, :] > pos[:, None] - window)
        s = tile_scores(q, k, softcap, USE_FP32, SOFTCAP)  # [BLOCK_M, BLOCK_N]
        s = tl.where(causal, s, float("-inf"))
        m, l, acc = online_softmax_update(s, v, m, l, acc, USE_FP32)

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + (q_start + i)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def _launch_prefill(query, cache: LayerCache, meta: AttentionMetadata, params: AttentionParams, max_q_len: int):
    # query: [total_new_tokens, num_heads, head_dim]; prefill_context_lens [batch], prefill_query_start_loc
    # [batch + 1]: int32
    total, num_heads, head_dim = query.shape
    k_cache, v_cache, block_tables = cache.k, cache.v, meta.prefill_block_tables
    num_kv_heads, block_size = cache.num_kv_heads, cache.block_size
    group, fp32 = tile_layout(query, cache, block_tables)
    out = torch.empty_like(query)
    if total == 0:
        return out
    block_m, block_n = (64, 64) if head_dim <= 128 else (32, 32)
    grid = (meta.num_prefills, num_kv_heads, triton.cdiv(max_q_len * group, block_m))
    k_scale, v_scale = scale_pointers(cache)
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, meta.prefill_context_lens, meta.prefill_query_start_loc,
        k_scale, v_scale, out,
        params.scale * LOG2E, params.window or 0, (params.logit_softcap or 0.0) * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0), k_scale.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_FP32=fp32, IS_FP8=is_fp8(k_cache.dtype), SOFTCAP=params.logit_softcap is not None,
    )
    return out


def triton_paged_prefill(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                         params: AttentionParams) -> torch.Tensor:
    """Same contract as ``reference.paged_prefill_reference``."""
    starts = meta.prefill_query_start_loc
    max_q_len = int((starts[1:] - starts[:-1]).max()) if query.shape[0] else 0  # one sync
    return _launch_prefill(query.contiguous() if query.stride(2) != 1 else query, cache, meta, params, max_q_len)
