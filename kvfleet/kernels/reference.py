"""Pure-torch definitions of the paged-attention operations, in float32, written for reading; every
kernel is tested, like these, against float64 attention over dense K/V (``kvfleet/kernels/testing.py``).

The layouts (pool, block tables, FP8 scale caches) are written once, in ``kvfleet/kernels/metadata.py``.
Outputs take the query's dtype.

FP8 caches hold ``x / scale`` with one float32 scale per token and KV head, ``amax(|x|) / 448`` over
the row's ``head_dim`` values. A row's scale is fixed when the row is written (a block fills token by
token, so a per-block scale would have to requantise the rows already there whenever a larger value
arrived); it costs 4 bytes per ``head_dim`` bytes (6% at head_dim 64) and keeps every row's relative
error at e4m3's 2^-4.

Scores are ``scale * q·k``, soft-capped when the layer says so (``cap * tanh(score / cap)``, Gemma 2),
then masked: causal, and with a sliding window (``window`` tokens) as transformers masks it, a query
at position ``p`` sees keys ``p - window < k <= p``. Keys older than every query's window are never
read, nor are their block-table entries: the engine gives those blocks back as a sequence grows.
"""

from __future__ import annotations

import torch

from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache, is_fp8

ROWS = 256  # prefill query rows scored at once: [H, ROWS, keys] float32 scores


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


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """Write K/V ``[num_tokens, num_kv_heads, head_dim]`` of new tokens at their slots
    ``slot_mapping [num_tokens]``, in place (FP8: their scales too). Negative slots (padding) are skipped."""
    key, value = prepare_store(key, value, cache, slot_mapping)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // cache.block_size, slots % cache.block_size
    for new, pages in ((key[keep], cache.k), (value[keep], cache.v)):
        if is_fp8(pages.dtype):  # index_put has no float8 kernel: move the bytes instead
            new, pages = new.view(torch.uint8), pages.view(torch.uint8)
        # pages[blocks, :, offsets]: [num_tokens, num_kv_heads, head_dim]
        pages[blocks, :, offsets] = new


def prepare_store(key: torch.Tensor, value: torch.Tensor, cache: LayerCache,
                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What every ``store_kv`` does before moving rows: K/V in the cache's dtype; for FP8 their
    scales are written into the scale caches here (a few bytes per row, plain torch indexing)."""
    key, k_scales = quantize_kv(key, cache.k.dtype)
    value, v_scales = quantize_kv(value, cache.k.dtype)
    if k_scales is not None:
        write_scales(cache.k_scale, slot_mapping, k_scales)
        write_scales(cache.v_scale, slot_mapping, v_scales)
    return key, value


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


def soft_cap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(scores / cap)``: scores squashed into ``(-cap, cap)`` (Gemma 2); None: as they are."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def paged_decode_reference(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                           params: AttentionParams) -> torch.Tensor:
    """One new token per decoding sequence attends to its ``decode_context_lens[b]`` cached tokens
    (the last ``window`` of them with a sliding window): a prefill chunk of one token each.

    query: [num_decodes, num_heads, head_dim] → out: the same shape (query's dtype).
    """
    out = torch.empty_like(query)
    for b, ctx in enumerate(meta.decode_context_lens.tolist()):
        out[b] = _attend(query[b:b + 1], cache, meta.decode_block_tables[b], ctx, params)[0]
    return out


def paged_prefill_reference(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                            params: AttentionParams) -> torch.Tensor:
    """Causal attention of packed new tokens over their cached prefix and themselves.

    query: [num_prefill_tokens, num_heads, head_dim], sequence b owns rows
    ``prefill_query_start_loc[b]:[b+1]``; they are the last ``q_len`` of its ``prefill_context_lens[b]``
    positions, so new token i sits at position ``context_len - q_len + i`` and sees keys ``0..that``::

        keys →   0 1 2 3 4 5      context_len 6, q_len 3 (offset 3)
        q0 (p3)  x x x x . .
        q1 (p4)  x x x x x .
        q2 (p5)  x x x x x x

    With ``window`` 2 each row keeps only its last two keys: q0 sees 2..3, q1 3..4, q2 4..5.
    Rows are taken ``ROWS`` at a time (scores of a long prompt would not fit): rows ``r0..r1`` of a
    chunk are the last ones of the sequence's first ``ctx - (q_len - r1)`` positions.
    """
    out = torch.empty_like(query)
    starts = meta.prefill_query_start_loc.tolist()
    for b, ctx in enumerate(meta.prefill_context_lens.tolist()):
        end = starts[b + 1]
        for r0 in range(starts[b], end, ROWS):
            r1 = min(end, r0 + ROWS)
            out[r0:r1] = _attend(query[r0:r1], cache, meta.prefill_block_tables[b], ctx - (end - r1), params)
    return out


def _attend(query: torch.Tensor, cache: LayerCache, block_table: torch.Tensor, ctx: int,
            params: AttentionParams) -> torch.Tensor:
    """The last ``q_len`` positions of a sequence of ``ctx`` tokens, ``query [q_len, H, D]``, over
    its keys: ``[q_len, H, D]`` in the query's dtype."""
    q_len, num_heads, head_dim = query.shape
    lo = window_start(ctx - q_len, params.window)
    k = gather_kv(cache.k, block_table, ctx, cache.k_scale, lo)  # [Hkv, ctx - lo, D]
    v = gather_kv(cache.v, block_table, ctx, cache.v_scale, lo)
    q = query.float().view(q_len, cache.num_kv_heads, -1, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, q_len, D]
    scores = soft_cap(q @ k[:, None].transpose(2, 3) * params.scale, params.logit_softcap)  # [Hkv, G, q_len, keys]
    positions = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
    keys = torch.arange(lo, ctx, device=query.device)
    hidden = keys > positions  # [q_len, keys]
    if params.window is not None:
        hidden |= keys <= positions - params.window
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return (probs @ v[:, None]).permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(query.dtype)
