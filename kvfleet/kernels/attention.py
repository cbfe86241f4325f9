"""The entry points the engine calls: each picks an implementation by device and environment.

- CUDA tensors → Triton kernels (``triton_store``, ``triton_decode``, ``triton_prefill``).
- CPU decode and KV store → the native C++ kernels (``cpu_kernels``), built on first use; if they
  cannot be built, the torch reference, with one logged warning.
- CPU prefill → ``cpu_prefill`` (compute-bound): the native causal kernel in float32 and bfloat16,
  else torch's fused attention or each sequence's blocks gathered once and float32 GEMMs.
- ``KVFLEET_ATTENTION=reference`` forces the reference everywhere.

Every implementation takes the same four things: the query (or new K/V), the layer's ``LayerCache``,
the step's ``AttentionMetadata`` and the layer's ``AttentionParams`` (``kvfleet/kernels/metadata.py``, where
their layouts are written and checked, once, when they are built). What is left to check here is
the query against them, a few integer comparisons per call.
"""

from __future__ import annotations

import os

import torch

from kvfleet.kernels import cpu_kernels, reference
from kvfleet.kernels.cpu_prefill import cpu_paged_prefill
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache


def _use_reference() -> bool:
    return os.environ.get("KVFLEET_ATTENTION", "").lower() == "reference"


def _check_rows(x: torch.Tensor, cache: LayerCache, rows: int, heads_per_kv_head: bool) -> None:
    # x: query [rows, num_heads, head_dim] (num_heads a multiple of num_kv_heads), or new K/V [rows, Hkv, D]
    assert x.dim() == 3 and x.shape[0] == rows and x.shape[2] == cache.head_dim, (tuple(x.shape), rows, cache.k.shape)
    heads_fit = x.shape[1] % cache.num_kv_heads == 0 if heads_per_kv_head else x.shape[1] == cache.num_kv_heads
    assert heads_fit, f"{x.shape[1]} heads do not fit {cache.num_kv_heads} KV heads"
    assert x.device == cache.k.device, f"{x.device} tensors against a cache on {cache.k.device}"


def store_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """Write new K/V ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping`` ``[num_tokens]``
    (``AttentionMetadata.slot_mapping``; negative: padding); tests and pool builders pass any slots."""
    _check_rows(key, cache, slot_mapping.shape[0], heads_per_kv_head=False)
    assert value.shape == key.shape, (value.shape, key.shape)
    if _use_reference():
        return reference.store_kv_reference(key, value, cache, slot_mapping)
    if cache.k.is_cuda:
        from kvfleet.kernels.triton_store import triton_store_kv

        return triton_store_kv(key, value, cache, slot_mapping)
    if cpu_kernels.supports_store(cache):
        return cpu_kernels.cpu_store_kv(key, value, cache, slot_mapping)
    return reference.store_kv_reference(key, value, cache, slot_mapping)


def paged_decode(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                 params: AttentionParams) -> torch.Tensor:
    """Attention of each decoding sequence's new token over its paged KV; query and output
    ``[num_decodes, num_heads, head_dim]``."""
    _check_rows(query, cache, meta.num_decodes, heads_per_kv_head=True)
    if _use_reference():
        return reference.paged_decode_reference(query, cache, meta, params)
    if query.is_cuda:
        from kvfleet.kernels.triton_decode import triton_paged_decode

        return triton_paged_decode(query, cache, meta, params)
    if cpu_kernels.supports(query, cache):
        return cpu_kernels.cpu_paged_decode(query, cache, meta, params)
    return reference.paged_decode_reference(query, cache, meta, params)


def paged_prefill(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata,
                  params: AttentionParams) -> torch.Tensor:
    """Causal attention of the packed prefill chunks over their cached prefix and themselves; query
    and output ``[num_prefill_tokens, num_heads, head_dim]``."""
    _check_rows(query, cache, meta.num_prefill_tokens, heads_per_kv_head=True)
    if _use_reference():
        return reference.paged_prefill_reference(query, cache, meta, params)
    if query.is_cuda:
        from kvfleet.kernels.triton_prefill import triton_paged_prefill

        return triton_paged_prefill(query, cache, meta, params)
    return cpu_paged_prefill(query, cache, meta, params)
