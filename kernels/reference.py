"""Pure-torch definitions of the paged-attention operations; every other kernel is tested against these.

KV pool layout of one layer (the engine slices it out of ``kv_cache[layer, 0|1]``)::

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
                       └─ block_id ─┘└─ kv head ─┘└─ offset ─┘
    slot = block_id * block_size + offset

A sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset
``p % block_size``. FP8 caches (``torch.float8_e4m3fn``) hold ``x / scale`` with one float32 scale per
KV head. All arithmetic here is float32; outputs take the query's dtype.

Sliding window (``window`` tokens, ``None``: full attention), as transformers masks it: a query at
position ``p`` sees keys ``p - window < k <= p``. Keys older than every query's window are never
read, nor are their block-table entries: the engine gives those blocks back as a sequence grows.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """Turn new K or V ``[num_tokens, num_kv_heads, head_dim]`` into the cache's dtype."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    x = x.float()
    if scale is not None:
        x = x / scale.float().view(1, -1, 1)
    fmax = torch.finfo(cache_dtype).max
    return x.clamp(-fmax, fmax).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, head_dim_index: int) -> torch.Tensor:
    """Float32 view of cached K or V; ``head_dim_index`` is the kv-head dimension of ``x``."""
    x = x.float()
    if scale is not None:
        shape = [1] * x.dim()
        shape[head_dim_index] = -1
        x = x * scale.float().view(shape)
    return x


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write K/V of new tokens at their slots, in place. Negative slots (padding) are skipped."""
    # key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    for new, cache, scale in ((key[keep], k_cache, k_scale), (value[keep], v_cache, v_scale)):
        new = quantize_kv(new, cache.dtype, scale)
        if is_fp8(cache.dtype):  # index_put has no float8 kernel: move the bytes instead
            new, cache = new.view(torch.uint8), cache.view(torch.uint8)
        # cache[blocks, :, offsets]: [num_tokens, num_kv_heads, head_dim]
        cache[blocks, :, offsets] = new


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: torch.Tensor | None,
    start: int = 0,
) -> torch.Tensor:
    """Float32 copy of one sequence's K or V at positions ``[start, context_len)``:
    ``[num_kv_heads, context_len - start, head_dim]``; blocks before ``start``'s are not touched."""
    bs = cache.shape[2]
    first, num_blocks_used = start // bs, -(-context_len // bs)
    blocks = cache[block_table[first:num_blocks_used].long()]  # [n, Hkv, bs, D]
    kv = blocks.transpose(0, 1).flatten(1, 2)[:, start - first * bs:context_len - first * bs]  # [Hkv, ctx, D]
    return dequantize_kv(kv, scale, head_dim_index=0)


def window_start(first_position: int, window: int | None) -> int:
    """The oldest key a query at ``first_position`` (or later) can see."""
    return 0 if window is None else max(0, first_position - window + 1)


def paged_decode_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One new token per sequence attends to its ``context_lens[b]`` cached tokens (the last
    ``window`` of them with a sliding window).

    query: [batch, num_heads, head_dim] → out: [batch, num_heads, head_dim] (query's dtype).
    """
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for b, ctx in enumerate(context_lens.tolist()):
        lo = window_start(ctx - 1, window)
        k = gather_kv(k_cache, block_tables[b], ctx, k_scale, lo)  # [Hkv, ctx - lo, D]
        v = gather_kv(v_cache, block_tables[b], ctx, v_scale, lo)
        q = query[b].float().view(num_kv_heads, group, head_dim)  # [Hkv, G, D]
        probs = torch.softmax(q @ k.transpose(1, 2) * scale, dim=-1)  # [Hkv, G, ctx]
        out[b] = (probs @ v).view(num_heads, head_dim).to(query.dtype)
    return out


def paged_prefill_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their cached prefix and themselves.

    query: [total_new_tokens, num_heads, head_dim], sequence b owns rows
    ``query_start_loc[b]:query_start_loc[b+1]``; they are the last ``q_len`` of its ``context_lens[b]``
    positions, so new token i sits at position ``context_len - q_len + i`` and sees keys ``0..that``::

        keys →   0 1 2 3 4 5      context_len 6, q_len 3 (offset 3)
        q0 (p3)  x x x x . .
        q1 (p4)  x x x x x .
        q2 (p5)  x x x x x x

    With ``window`` 2 each row keeps only its last two keys: q0 sees 2..3, q1 3..4, q2 4..5.
    """
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[1]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for b, ctx in enumerate(context_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        lo = window_start(ctx - q_len, window)
        k = gather_kv(k_cache, block_tables[b], ctx, k_scale, lo)  # [Hkv, ctx - lo, D]
        v = gather_kv(v_cache, block_tables[b], ctx, v_scale, lo)
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
        if q_len == ctx and window is None:
            mask, causal = None, True
        else:
            positions = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
            keys = torch.arange(lo, ctx, device=query.device)
            mask = keys <= positions  # [q_len, ctx - lo]
            if window is not None:
                mask &= keys > positions - window
            causal = False
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )  # [H, q_len, D]
        out[start:end] = o.transpose(0, 1).to(query.dtype)
    return out
