"""The host tier's memory: block slots shaped like the pool's blocks, and the copies between them.

    pool:  kv_cache [layers, 2, num_blocks, kv_heads, block_size, head_dim]   (+ kv_scales, FP8)
    host:  kv       [num_slots, layers, 2, kv_heads, block_size, head_dim]   (+ scales)

A host slot is one contiguous block (every layer's K and V, and FP8 scales), so it goes to a disk
file as one run of bytes. With the pool on CUDA the host tensors are pinned and every copy runs on
a side stream: ``KVTierStore`` makes the forward wait on it (``before_forward``), so demotions and
promotions overlap the CPU's scheduling instead of stalling the device's stream.
"""

from __future__ import annotations

import numpy as np
import torch


class HostPool:
    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, num_slots: int) -> None:
        layers, two, _, heads, block_size, head_dim = kv_cache.shape
        pin = kv_cache.is_cuda
        self.kv = torch.empty((num_slots, layers, two, heads, block_size, head_dim), dtype=kv_cache.dtype,
                              pin_memory=pin)
        self.scales = None if kv_scales is None else torch.empty((num_slots, layers, two, heads, block_size),
                                                                 dtype=torch.float32, pin_memory=pin)
        self.pool, self.pool_scales = kv_cache, kv_scales
        per_slot = self.kv[0].numel() * self.kv.element_size()
        self.scale_bytes = 0 if self.scales is None else self.scales[0].numel() * 4
        self.block_bytes = per_slot + self.scale_bytes

    def from_pool(self, blocks: list[int], slots: list[int]) -> None:
        """Host ``slots[i]`` = pool block ``blocks[i]`` (on the current stream)."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.pool.device)
        _copy_rows(self.kv, slots, self.pool[:, :, idx].permute(2, 0, 1, 3, 4, 5))
        if self.scales is not None:
            _copy_rows(self.scales, slots, self.pool_scales[:, :, idx].permute(2, 0, 1, 3, 4))

    def to_pool(self, slots: list[int], blocks: list[int]) -> None:
        """Pool block ``blocks[i]`` = host ``slots[i]`` (on the current stream)."""
        dev = self.pool.device
        idx = torch.tensor(blocks, dtype=torch.int64, device=dev)
        self.pool[:, :, idx] = _gather(self.kv, slots, dev).permute(1, 2, 0, 3, 4, 5)
        if self.scales is not None:
            self.pool_scales[:, :, idx] = _gather(self.scales, slots, dev).permute(1, 2, 0, 3, 4)

    def bytes_of(self, slot: int) -> np.ndarray:
        """Slot ``slot``'s block as bytes (KV then scales): a view, valid until the slot is written."""
        kv = self.kv[slot].reshape(-1).view(torch.uint8).numpy()
        if self.scales is None:
            return kv
        return np.concatenate([kv, self.scales[slot].reshape(-1).view(torch.uint8).numpy()])

    def block_from_bytes(self, data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A block read back from ``bytes_of``'s layout, as ``(kv, scales)`` tensors of one slot."""
        raw = torch.from_numpy(np.ascontiguousarray(data))
        split = self.block_bytes - self.scale_bytes
        kv = raw[:split].view(self.kv.dtype).reshape(self.kv.shape[1:])
        scales = None if self.scales is None else raw[split:].view(torch.float32).reshape(self.scales.shape[1:])
        return kv, scales

    def block_to_pool(self, kv: torch.Tensor, scales: torch.Tensor | None, block: int) -> None:
        self.pool[:, :, block] = kv.to(self.pool.device)
        if scales is not None:
            self.pool_scales[:, :, block] = scales.to(self.pool.device)


def _copy_rows(host: torch.Tensor, slots: list[int], rows: torch.Tensor) -> None:
    if not host.is_pinned():
        host[torch.tensor(slots, dtype=torch.int64)] = rows
        return
    rows = rows.contiguous()
    for i, slot in enumerate(slots):
        host[slot].copy_(rows[i], non_blocking=True)


def _gather(host: torch.Tensor, slots: list[int], device: torch.device) -> torch.Tensor:
    """Host ``slots`` on ``device``, stacked; from pinned memory each slot (contiguous) is copied
    asynchronously into a staging tensor of the current stream."""
    if not host.is_pinned():
        return host[torch.tensor(slots, dtype=torch.int64)].to(device)
    staged = torch.empty((len(slots), *host.shape[1:]), dtype=host.dtype, device=device)
    for i, slot in enumerate(slots):
        staged[i].copy_(host[slot], non_blocking=True)
    return staged
