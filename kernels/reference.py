"""Pure-torch definitions of the paged-attention operations; every other kernel is tested against these.

KV pool layout of one layer (the engine slices it out of ``kv_cache[layer, 0|1]``)::

    k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
                       └─ block_id ─┘└─ kv head ─┘└─ offset ─┘
    slot = block_id * block_size + offset

A sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset
``p % block_size``. All arithmetic here is float32; outputs take the query's dtype.

FP8 caches (``torch.float8_e4m3fn``) hold ``x / scale`` with one float32 scale per token and KV head,
``amax(|x|) / 448`` over the row's ``head_dim`` values, in scale caches laid out like the cache minus
its last dimension (one float per row)::

    k_scale, v_scale: [num_blocks, num_kv_heads, block_size]      row (block, head, offset) ↔ its scale

A row's scale is fixed when the row is written (a block fills token by token, so a per-block scale
would have to requantise the rows already there whenever a larger value arrived); it costs 4 bytes
per ``head_dim`` bytes (6% at head_dim 64) and keeps every row's relative error at e4m3's 2^-4.

Sliding window (``window`` tokens, ``None``: full attention), as transformers masks it: a query at
position ``p`` sees keys ``p - window < k <= p``. Keys older than every query's window are never
read, nor are their block-table entries: the engine gives those blocks back as a sequence grows.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (getattr(torch, "float8_e4m3fn", None),)
SCALE_DTYPE = torch.float32  # the scale caches' dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New K or V ``[num_tokens, num_kv_heads, head_dim]`` in the cache's dtype, and for FP8 the
    scales ``[num_tokens, num_kv_heads]`` (float32) that turn it back: ``x ≈ q * scale``."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype), None
    x = x.float()
    fmax = torch.finfo(cache_dtype).max
    # an all-zero row gets the smallest normal scale, not 0 (0 / 0 would store NaN)
    scale = (x.abs().amax(dim=-1) / fmax).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale[..., None]).clamp(-fmax, fmax).to(cache_dtype), scale


def write_scales(scale_cache: torch.Tensor, slot_mapping: torch.Tensor, scales: torch.Tensor) -> None:
    """``scale_cache [num_blocks, Hkv, block_size]`` at ``slot_mapping``'s non-negative slots gets
    ``scales [num_tokens, Hkv]``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = scale_cache.shape[2]
    scale_cache[slots // block_size, :, slots % block_size] = scales[keep].to(scale_cache.dtype)


def store_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write K/V of new tokens at their slots, in place (FP8: their scales too, into the scale
    caches ``k_scale``/``v_scale``). Negative slots (padding) are skipped."""
    # key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]
    key, value = prepare_store(key, value, k_cache, slot_mapping, k_scale, v_scale)
    block_size = k_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    for new, cache in ((key[keep], k_cache), (value[keep], v_cache)):
        if is_fp8(cache.dtype):  # index_put has no float8 kernel: move the bytes instead
            new, cache = new.view(torch.uint8), cache.view(torch.uint8)
        # cache[blocks, :, offsets]: [num_tokens, num_kv_heads, head_dim]
        cache[blocks, :, offsets] = new


def prepare_store(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What every ``store_kv`` does before moving rows: K/V in the cache's dtype; for FP8 their
    scales are written into the scale caches here (a few bytes per row, plain torch indexing)."""
    check_scales(k_cache, k_scale, v_scale)
    key, k_scales = quantize_kv(key, k_cache.dtype)
    value, v_scales = quantize_kv(value, k_cache.dtype)
    if k_scales is not None:
        write_scales(k_scale, slot_mapping, k_scales)
        write_scales(v_scale, slot_mapping, v_scales)
    return key, value


def check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """FP8 caches come with both scale caches, shaped like the cache minus ``head_dim``; others with none."""
    if not is_fp8(cache.dtype):
        assert k_scale is None and v_scale is None, "scales belong to FP8 caches only"
        return
    assert k_scale is not None and v_scale is not None, "an FP8 cache needs its k_scale and v_scale caches"
    assert k_scale.shape == v_scale.shape == cache.shape[:3], (k_scale.shape, cache.shape)
    assert k_scale.dtype == v_scale.dtype == SCALE_DTYPE


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int, scale: torch.Tensor | None,
    start: int = 0,
) -> torch.Tensor:
    """Float32 copy of one sequence's K or V at positions ``[start, context_len)``, dequantised with
    the scale cache ``scale`` (FP8): ``[num_kv_heads, context_len - start, head_dim]``; blocks before
    ``start``'s are not touched."""
    bs = cache.shape[2]
    first, num_blocks_used = start // bs, -(-context_len // bs)
    ids = block_table[first:num_blocks_used].long()
    span = slice(start - first * bs, context_len - first * bs)
    kv = cache[ids].transpose(0, 1).flatten(1, 2)[:, span].float()  # [Hkv, ctx - start, D]
    if scale is not None:
        kv = kv * scale[ids].transpose(0, 1).flatten(1, 2)[:, span, None]  # scales: [Hkv, ctx - start]
    return kv


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
