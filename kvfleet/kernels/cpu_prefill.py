"""Paged prefill on CPU: per sequence, the native causal kernel, torch's flash attention or GEMMs.

In float32 or bfloat16 (query and cache alike), with no window cutting into the context, no soft-cap
and no FP8, the native kernel (``csrc/prefill_cpu.cpp``) serves every sequence, with or without a
cached prefix: flash attention's online softmax over 64-key tiles with a matrix kernel's register
blocking, in float32 (bfloat16 rows widened once per call). At one thread, 12 heads over 4 KV heads
of 64, it took 0.28 / 12.6 / 65.7 ms at 128 / 512 / 1,024 tokens against torch's fused kernel's 0.82
/ 32.6 / 146.4 ms in float32 (2.2-3.0x), and 2.3-4.7x in bfloat16 (measured while other work loaded
the machine; float32 results within float32 rounding of it). The rest:

A sequence with no cached prefix (its whole prompt in this step, no sliding window cutting into it)
attends to exactly its own new tokens, causally: torch's fused flash attention
(``scaled_dot_product_attention``, ``is_causal``) serves it in the pool's dtype, 1.3-2x faster than
the GEMMs below at 145-4,096 tokens with one thread in torch 2.13 (bfloat16 and float32 alike;
float32 outputs within 1e-6 of them). The rest, prompts that continue a cached prefix (chunked
prefill, prefix-cache hits), sliding windows, FP8 caches and soft-capped scores (``cap * tanh(s /
cap)`` in place, before the mask), take the GEMMs. Rows of new tokens are taken in chunks so that one
chunk's scores ``[num_kv_heads, G, rows, keys]`` stay under a memory budget, and a chunk multiplies
only the keys its last row can see::

    keys →      0 .. prefix ..  | new tokens (causal)
    chunk 0 rows  x x x x x x x   x . . . . .       kv_end = prefix + rows of chunks 0..0
    chunk 1 rows  x x x x x x x   x x x x . .       kv_end grows by one chunk each time

With a sliding window a chunk also starts its keys at the oldest one its first row sees
(``kv_lo``), and masks, per row, the keys that fell out of that row's window.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet.kernels import cpu_kernels
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache
from kvfleet.kernels.reference import gather_kv, window_start

SCORE_BUDGET = 2 << 20  # float32 scores per chunk (8 MiB: under malloc's mmap threshold, no page faults)


def cpu_paged_prefill(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                      params: AttentionParams) -> torch.Tensor:
    """Same contract as ``reference.paged_prefill_reference``."""
    total, num_heads, head_dim = query.shape
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    window, cap = params.window, params.logit_softcap
    out = torch.empty_like(query)
    native = cpu_kernels.supports_prefill(query, cache)
    starts = meta.prefill_query_start_loc.tolist()
    for b, ctx in enumerate(meta.prefill_context_lens.tolist()):
        start, q_len = starts[b], starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        prefix, table = ctx - q_len, meta.prefill_block_tables[b]
        plain = cache.k_scale is None and cap is None and (window is None or window >= ctx)
        if plain and native:
            out[start : start + q_len] = cpu_kernels.causal_prefill(query[start : start + q_len], cache, table, ctx,
                                                                    params.scale)
            continue
        if prefix == 0 and cache.k_scale is None and cap is None and (window is None or window >= q_len):
            out[start : start + q_len] = _causal_self_attention(query[start : start + q_len], cache, table,
                                                                params.scale)
            continue
        lo = window_start(prefix, window)
        k = gather_kv(cache.k, table, ctx, cache.k_scale, lo)  # [Hkv, ctx - lo, D]: key j is position lo + j
        v = gather_kv(cache.v, table, ctx, cache.v_scale, lo)
        # q: [Hkv, G, q_len, D], scaled
        q = (query[start : start + q_len].float() * params.scale).view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3)
        span = ctx - lo if window is None else min(ctx - lo, window + q_len)
        rows = max(16, SCORE_BUDGET // (num_heads * span))
        buf = torch.empty(num_heads * min(rows, q_len) * span)  # scores of one chunk, reused
        for r0 in range(0, q_len, rows):
            r1 = min(q_len, r0 + rows)
            kv_lo, kv_end, m = window_start(prefix + r0, window), prefix + r1, r1 - r0
            n = kv_end - kv_lo
            # one bmm per KV head: [Hkv, G*m, D] @ [Hkv, D, n] (a broadcast K would be copied G times)
            scores = buf[: num_heads * m * n].view(num_kv_heads, group * m, n)
            torch.bmm(q[:, :, r0:r1].reshape(num_kv_heads, group * m, head_dim),
                      k[:, kv_lo - lo:kv_end - lo].transpose(1, 2), out=scores)
            if cap is not None:
                scores.div_(cap).tanh_().mul_(cap)
            positions = torch.arange(prefix + r0, prefix + r1)[:, None]
            if window is None:  # the causal part only: [m, keys after the first row]
                hidden = torch.arange(prefix + r0 + 1, kv_end) > positions
                scores.view(num_kv_heads, group, m, n)[..., prefix + r0 + 1 - kv_lo :].masked_fill_(hidden, float("-inf"))
            else:
                keys = torch.arange(kv_lo, kv_end)
                hidden = (keys > positions) | (keys <= positions - window)  # [m, n]
                scores.view(num_kv_heads, group, m, n).masked_fill_(hidden, float("-inf"))
            # softmax in place; its denominator divides the [G*m, D] output instead of the scores
            scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
            o = torch.bmm(scores, v[:, kv_lo - lo:kv_end - lo]).div_(scores.sum(dim=-1, keepdim=True))
            out[start + r0 : start + r1] = o.view(num_kv_heads, group, m, head_dim).permute(2, 0, 1, 3).reshape(
                m, num_heads, head_dim)
    return out


def _causal_self_attention(query: torch.Tensor, cache: LayerCache, block_table: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Causal attention of ``query`` ``[n, H, D]`` over the ``n`` keys just stored at the start of
    ``block_table``: torch's fused kernel, in the cache's dtype (it accumulates in float32). It has
    no soft-cap: soft-capped layers take the GEMMs."""
    n = query.shape[0]
    ids = block_table[: -(-n // cache.block_size)].long()
    k = cache.k[ids].transpose(0, 1).flatten(1, 2)[None, :, :n]  # [1, Hkv, n, D]
    v = cache.v[ids].transpose(0, 1).flatten(1, 2)[None, :, :n]
    out = F.scaled_dot_product_attention(query.transpose(0, 1)[None].to(k.dtype), k, v, is_causal=True, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)
