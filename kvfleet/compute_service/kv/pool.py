"""The node's KV pool: block-size rules, its dtype, sizing from a memory budget, and the preallocated
tensors.

    kv_cache:  [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size, head_dim]
    kv_scales: [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size]   float32, FP8 caches only

Each (block, kv head) is a contiguous ``block_size x head_dim`` tile, so kernels read a block in place;
an FP8 row's scale sits at the same (block, head, offset) of ``kv_scales``. A block's bytes count both.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

from kvfleet.compute_service.kv.block_size import BLOCK_SIZE_PRESETS, parse_block_size  # noqa: F401 - named here too
from kvfleet.compute_service.kv.cache_dtype import fp8_unsupported_reason, kv_bytes_per_token, resolve_kv_cache_dtype
from kvfleet.compute_service.model.config import ModelConfig

DEFAULT_MEMORY_FRACTION = 0.25


KV_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "fp8_e4m3": getattr(torch, "float8_e4m3fn", None)}
_NAMES = {dtype: name for name, dtype in KV_TORCH_DTYPES.items() if dtype is not None}


def kv_cache_dtype(name: str, model_dtype: str, device: torch.device) -> torch.dtype:
    """The pool's torch dtype for ``--kv-cache-dtype name``; ``ValueError`` (one line) for an unknown
    name or FP8 where this torch or device cannot hold it."""
    name = resolve_kv_cache_dtype(name, model_dtype)
    if name == "fp8_e4m3":
        on_gpu = device.type == "cuda" and torch.cuda.is_available()
        capability = torch.cuda.get_device_capability(device) if on_gpu else None
        reason = fp8_unsupported_reason(KV_TORCH_DTYPES["fp8_e4m3"] is not None, device.type, capability)
        if reason is not None:
            raise ValueError(reason)
    return KV_TORCH_DTYPES[name]


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype | str) -> int:
    """``block_size`` tokens x (2 (K and V) x layers x kv_heads x (head_dim x element bytes + scale
    bytes)); ``dtype`` a torch dtype or a ``--kv-cache-dtype`` name other than auto."""
    name = dtype if isinstance(dtype, str) else _NAMES[dtype]
    return kv_bytes_per_token(config.num_layers, config.num_kv_heads, config.head_dim, name) * block_size


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_for(config: ModelConfig, block_size: int, dtype: torch.dtype | str, device: torch.device,
                   kv_cache_memory: int | None, memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    budget = kv_cache_memory if kv_cache_memory is not None else int(available_memory(device) * memory_fraction)
    per_block = bytes_per_block(config, block_size, dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache memory {budget} bytes holds no block of {per_block} bytes "
                         f"(block_size {block_size}); raise --kv-cache-memory or lower --block-size")
    return num_blocks


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(kv_cache, kv_scales)``: the pool, and for FP8 its per-row scales (None otherwise)."""
    shape = (config.num_layers, 2, num_blocks, config.num_kv_heads, block_size)
    kv_cache = untouched_zeros((*shape, config.head_dim), dtype, device)
    scales = torch.ones(shape, dtype=torch.float32, device=device) if dtype == KV_TORCH_DTYPES["fp8_e4m3"] else None
    return kv_cache, scales


def untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that take no resident memory until written: on CPU a private anonymous mapping, whose
    pages the kernel hands out zero-filled on first touch (``torch.zeros`` writes every page at
    once: a 1 GiB pool was 1 GiB resident before the first request). The values are the same
    zeros, so nothing that reads a block before it is written sees anything else."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
