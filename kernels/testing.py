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

from kernels import reference


@dataclass(slots=True)
class PagedCase:
    query: torch.Tensor  # decode: [batch, H, D]; prefill: [total_new_tokens, H, D]
    k_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [batch, max_blocks] int32, padded with an out-of-range id
    context_lens: torch.Tensor  # [batch] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32
    k_scale: torch.Tensor | None  # [num_blocks, Hkv, block_size] float32 scale caches, FP8 only
    v_scale: torch.Tensor | None
    keys: list[torch.Tensor]  # per sequence [Hkv, ctx, D] float64, dequantised: the truth
    values: list[torch.Tensor]
    scale: float
    window: int | None = None

    def decode_args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.scale,
                self.k_scale, self.v_scale, self.window)

    def prefill_args(self):
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.context_lens,
                self.query_start_loc, self.scale, self.k_scale, self.v_scale, self.window)


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
) -> PagedCase:
    """``q_lens`` None → a decode case (one query per sequence); ``window``: a sliding window."""
    gen = torch.Generator().manual_seed(seed)
    cache_dtype = cache_dtype or dtype
    fp8 = reference.is_fp8(cache_dtype)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2
    tables = torch.full((len(context_lens), max_blocks), num_blocks + 1000, dtype=torch.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=torch.float32).to(cache_dtype)
    v_cache = torch.full(shape, float("nan"), dtype=torch.float32).to(cache_dtype)
    k_scale = v_scale = None
    if fp8:  # unused slots' scales are NaN too
        k_scale = torch.full(shape[:3], float("nan"))
        v_scale = torch.full(shape[:3], float("nan"))
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
        reference.store_kv_reference(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        # The truth is what the cache holds, dequantised, in float64.
        keys.append(_dense(k_cache, ids, ctx, k_scale))
        values.append(_dense(v_cache, ids, ctx, v_scale))
    q_lens = q_lens if q_lens is not None else [1] * len(context_lens)
    for b, ctx in enumerate(context_lens):
        if window is not None:
            _poison_outside(k_cache, v_cache, tables[b], reference.window_start(ctx - q_lens[b], window),
                            block_size, num_blocks + 1000)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return PagedCase(
        to(query), to(k_cache), to(v_cache), to(tables), to(torch.tensor(context_lens, dtype=torch.int32)),
        to(starts), to(k_scale), to(v_scale), keys, values, head_dim**-0.5, window,
    )


def _poison_outside(k_cache, v_cache, table, first_seen: int, block_size: int, bad_id: int) -> None:
    """NaN at positions ``< first_seen`` of one sequence; blocks wholly before it leave its table."""
    for p in range(first_seen):
        block = int(table[p // block_size])
        if block != bad_id:
            for cache in (k_cache, v_cache):
                cache[block, :, p % block_size] = torch.full_like(cache[block, :, p % block_size], float("nan"),
                                                                  dtype=torch.float32).to(cache.dtype)
    table[: first_seen // block_size] = bad_id


def _dense(cache, ids, ctx, scale):
    x = cache[torch.tensor(ids)].double().transpose(0, 1).flatten(1, 2)[:, :ctx]
    if scale is None:
        return x
    return x * scale[torch.tensor(ids)].double().transpose(0, 1).flatten(1, 2)[:, :ctx, None]


def dense_attention(case: PagedCase) -> torch.Tensor:
    """Float64 causal attention from the dense per-sequence K/V; rows as ``case.query``."""
    out = torch.empty(case.query.shape, dtype=torch.float64)
    starts = case.query_start_loc.tolist()
    num_heads = case.query.shape[1]
    for b, (k, v) in enumerate(zip(case.keys, case.values)):
        s, e = starts[b], starts[b + 1]
        ctx, q_len = k.shape[1], e - s
        group = num_heads // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)  # [H, ctx, D]
        q = case.query[s:e].cpu().double().transpose(0, 1)  # [H, q_len, D]
        scores = q @ k.transpose(1, 2) * case.scale
        pos = torch.arange(ctx - q_len, ctx)[:, None]
        hidden = torch.arange(ctx) > pos
        if case.window is not None:
            hidden |= torch.arange(ctx) <= pos - case.window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[s:e] = (torch.softmax(scores, -1) @ v).transpose(0, 1)
    return out


TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def assert_close(out: torch.Tensor, truth: torch.Tensor) -> None:
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.cpu().double(), truth, rtol=tol, atol=tol)
