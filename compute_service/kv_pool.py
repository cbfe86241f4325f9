"""The node's KV pool: block-size rules, sizing from a memory budget, and the one preallocated tensor.

    kv_cache: [num_layers, 2 (K, V), num_blocks, num_kv_heads, block_size, head_dim]

Each (block, kv head) is a contiguous ``block_size x head_dim`` tile, so kernels read a block in place.
"""

from __future__ import annotations

import os

import torch

from compute_service.model_config import ModelConfig

BLOCK_SIZE_PRESETS = {"chat": 256, "code": 512, "document": 1024}
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 2048
DEFAULT_MEMORY_FRACTION = 0.25


def parse_block_size(value: int | str) -> int:
    """A block size (multiple of 16 in 16–2048) or a preset name (chat, code, document)."""
    if isinstance(value, str) and value in BLOCK_SIZE_PRESETS:
        return BLOCK_SIZE_PRESETS[value]
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"block_size must be an integer or one of {sorted(BLOCK_SIZE_PRESETS)}, "
                         f"got {value!r}") from None
    if size % 16 or not MIN_BLOCK_SIZE <= size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be a multiple of 16 in {MIN_BLOCK_SIZE}-{MAX_BLOCK_SIZE}, got {size}")
    return size


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes x block_size."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * item * block_size


def available_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_blocks_for(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                   kv_cache_memory: int | None, memory_fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    budget = kv_cache_memory if kv_cache_memory is not None else int(available_memory(device) * memory_fraction)
    per_block = bytes_per_block(config, block_size, dtype)
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache memory {budget} bytes holds no block of {per_block} bytes "
                         f"(block_size {block_size}); raise --kv-cache-memory or lower --block-size")
    return num_blocks


def allocate_kv_cache(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    return torch.zeros(config.num_layers, 2, num_blocks, config.num_kv_heads, block_size,
                       config.head_dim, dtype=dtype, device=device)
