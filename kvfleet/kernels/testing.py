"""Paged-attention test cases, shared by tests/kernels and bench/gpu_kernels.sh.

A case is a shuffled pool whose unused slots hold NaN and whose block tables are padded with an
out-of-range id, so a kernel that reads past a context poisons its output or faults. The truth is
float64 attention over dense per-sequence K/V.

With a sliding ``window`` the keys older than every query's window are NaN in the pool and the table
entries of blocks wholly older than that are the out-of-range id too (the engine gives those blocks
back): a kernel that reads outside the window poisons its output or faults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfleet.kernels import reference
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache, is_fp8


@dataclass(slots=True)
class PagedCase:
    query: torch.Tensor  # decode: [batch, H, D]; prefill: [total_new_tokens, H, D]
    cache: LayerCache  # [num_blocks, Hkv, block_size, D], FP8 with its scale caches
    meta: AttentionMetadata  # a decode-only or a prefill-only step; block tables padded with an out-of-range id
    params: AttentionParams
    keys: list[torch.Tensor]  # per sequence [Hkv, ctx, D] float64, dequantised: the truth
    values: list[torch.Tensor]
    query_start_loc: list[int]  # [batch + 1]: sequence b's query rows, decode cases included

    def args(self) -> tuple[torch.Tensor, LayerCache, AttentionMetadata, AttentionParams]:
        """What every paged_decode / paged_prefill implementation takes."""
        return self.query, self.cache, self.meta, self.params


def make_case(
    context_lens: list[int],
    q_lens: list[int] | None = None,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
    device: str = "cpu",
    window: int | None = None,
    logit_softcap: float | None = None,
) -> PagedCase:
    """``q_lens`` None → a decode case (one query per sequence); ``window``: a sliding window;
    ``logit_softcap``: soft-capped scores."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    fp8 = is_fp8(cache_dtype)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2
    tables = torch.full((len(context_lens), max_blocks), num_blocks + 1000, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    nan = torch.full(shape, float("nan"), dtype=torch.float32)
    scales = (torch.full(shape[:3], float("nan")), torch.full(shape[:3], float("nan"))) if fp8 else ()
    cache = LayerCache(nan.to(cache_dtype), nan.to(cache_dtype), *scales)  # unused slots' scales are NaN too
    keys, values = [], []
    for b, ctx in enumerate(context_lens):
        ids = [perm.pop() for _ in range(blocks_per_seq[b])]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        if fp8:  # rows of different magnitudes: each row's scale must meet its own row
            k = k * torch.rand(ctx, num_kv_heads, 1, generator=gen) * 3
            v = v * torch.rand(ctx, num_kv_heads, 1, generator=gen) * 3
        slots = torch.tensor(ids).repeat_interleave(block_size)[:ctx] * block_size + torch.arange(ctx) % block_size
        reference.store_kv_reference(k, v, cache, slots)
        # The truth is what the cache holds, dequantised, in float64.
        keys.append(_dense(cache.k, ids, ctx, cache.k_scale))
        values.append(_dense(cache.v, ids, ctx, cache.v_scale))
    decode = q_lens is None
    q_lens = [1] * len(context_lens) if decode else q_lens
    for b, ctx in enumerate(context_lens):
        if window is not None:
            _poison_outside(cache, tables[b], reference.window_start(ctx - q_lens[b], window), num_blocks + 1000)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    meta = (AttentionMetadata.decode_only(to(tables), to(lens)) if decode
            else AttentionMetadata.prefill_only(to(tables), to(lens), to(starts)))
    cache = LayerCache(to(cache.k), to(cache.v), to(cache.k_scale), to(cache.v_scale))
    params = AttentionParams(head_dim**-0.5, window, logit_softcap)
    return PagedCase(to(query), cache, meta, params, keys, values, starts.tolist())


def _poison_outside(cache: LayerCache, table, first_seen: int, bad_id: int) -> None:
    """NaN at positions ``< first_seen`` of one sequence; blocks wholly before it leave its table."""
    block_size = cache.block_size
    for p in range(first_seen):
        block = int(table[p // block_size])
        if block != bad_id:
            for pages in (cache.k, cache.v):
                pages[block, :, p % block_size] = torch.full_like(pages[block, :, p % block_size], float("nan"),
                                                                  dtype=torch.float32).to(pages.dtype)
    table[: first_seen // block_size] = bad_id


def _dense(cache, ids, ctx, scale):
    x = cache[torch.tensor(ids)].double().transpose(0, 1).flatten(1, 2)[:, :ctx]
    if scale is None:
        return x
    return x * scale[torch.tensor(ids)].double().transpose(0, 1).flatten(1, 2)[:, :ctx, None]


def dense_attention(case: PagedCase) -> torch.Tensor:
    """Float64 causal attention from the dense per-sequence K/V; rows as ``case.query``."""
    out = torch.empty(case.query.shape, dtype=torch.float64)
    starts, params = case.query_start_loc, case.params
    num_heads = case.query.shape[1]
    for b, (k, v) in enumerate(zip(case.keys, case.values)):
        s, e = starts[b], starts[b + 1]
        ctx, q_len = k.shape[1], e - s
        group = num_heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, ctx, D]
        q = case.query[s:e].cpu().double().transpose(0, 1)  # [H, q_len, D]
        scores = reference.soft_cap(q @ k.transpose(1, 2) * params.scale, params.logit_softcap)
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        hidden = torch.arange(ctx) > pos
        if params.window is not None:
            hidden |= torch.arange(ctx) <= pos - params.window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[s:e] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
    return out


TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_close(out: torch.Tensor, truth: torch.Tensor) -> None:
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.cpu().double(), truth, rtol=tol, atol=tol)
