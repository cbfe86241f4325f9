"""The entry points the engine calls: each picks an implementation by device and environment.

- CUDA tensors → Triton kernels (``triton_store``, ``triton_decode``, ``triton_prefill``).
- CPU decode and KV store → the native C++ kernels (``cpu_kernels``), built on first use; if they
  cannot be built, the torch reference, with one logged warning.
- CPU prefill → ``cpu_prefill`` (compute-bound: each sequence's blocks gathered once, then float32
  GEMMs, 2-3× faster than ``scaled_dot_product_attention`` at long prompts).
- ``KVFLEET_ATTENTION=reference`` forces the reference everywhere.

FP8 caches (``float8_e4m3fn``) come with ``k_scale``/``v_scale``: scale caches ``[num_blocks,
num_kv_heads, block_size]`` float32, one scale per token and KV head, which ``store_kv`` writes and
the attention calls read; other dtypes take none.

``window`` (``None``: full attention) is a sliding window in tokens, as transformers masks it: a
query at position ``p`` sees keys ``p - window < k <= p``. Every implementation reads neither the
keys outside it nor their block-table entries.
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_kernels, reference
from kernels.cpu_prefill import cpu_paged_prefill


def _use_reference() -> bool:
    return os.environ.get("KVFLEET_ATTENTION", "").lower() == "reference"


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim]
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype
    assert k_cache.shape[2] % 16 == 0, f"block_size {k_cache.shape[2]} is not a multiple of 16"


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write new K/V ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``."""
    if not k_cache.is_cuda and not _use_reference() and cpu_kernels.supports_store(k_cache):
        return cpu_kernels.cpu_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _check_cache(k_cache, v_cache)
    assert key.shape == value.shape and key.shape[1:] == (k_cache.shape[1], k_cache.shape[3])
    assert slot_mapping.shape == (key.shape[0],)
    if k_cache.is_cuda and not _use_reference():
        from kernels.triton_store import triton_store_kv

        return triton_store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return reference.store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode(
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
    """Attention of one new token per sequence over its paged KV; returns ``[batch, num_heads, head_dim]``."""
    assert window is None or window > 0, f"window must be positive or None, got {window}"
    args = (query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, window)
    # The native kernel checks its arguments itself: this path runs per layer per step.
    if not query.is_cuda and not _use_reference() and cpu_kernels.supports(query, k_cache):
        return cpu_kernels.cpu_paged_decode(*args)
    _check_cache(k_cache, v_cache)
    # query: [batch, num_heads, head_dim]; block_tables: [batch, max_blocks]; context_lens: [batch]
    assert query.dim() == 3 and query.shape[2] == k_cache.shape[3]
    assert query.shape[1] % k_cache.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
    assert block_tables.shape[0] == context_lens.shape[0] == query.shape[0]
    if query.is_cuda and not _use_reference():
        from kernels.triton_decode import triton_paged_decode

        return triton_paged_decode(*args)
    return reference.paged_decode_reference(*args)


def paged_prefill(
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
    """Causal attention of packed new tokens over cached prefix + themselves; returns query's shape."""
    _check_cache(k_cache, v_cache)
    assert window is None or window > 0, f"window must be positive or None, got {window}"
    # query: [total_new_tokens, num_heads, head_dim]; query_start_loc: [batch + 1]
    assert query.dim() == 3 and query.shape[2] == k_cache.shape[3]
    assert query.shape[1] % k_cache.shape[1] == 0, "num_heads must be a multiple of num_kv_heads"
    assert query_start_loc.shape[0] == context_lens.shape[0] + 1 == block_tables.shape[0] + 1
    args = (query, k_cache, v_cache, block_tables, context_lens, query_start_loc, scale, k_scale, v_scale, window)
    if _use_reference():
        return reference.paged_prefill_reference(*args)
    if query.is_cuda:
        from kernels.triton_prefill import triton_paged_prefill

        return triton_paged_prefill(*args)
    return cpu_paged_prefill(*args)
