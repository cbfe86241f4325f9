"""A KV snapshot of an FP8 pool keeps each row's scale: capture, file and restore over pool tensors
and an in-process page table (the FP8 attention kernels need a GPU; the file does not)."""

from __future__ import annotations

import pytest
import torch

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.compute_service.kv import snapshot_io as kv_snapshot_io
from kvfleet.compute_service.kv.block_usage import BlockUsage
from kvfleet.compute_service.kv.snapshot import Fingerprint, SnapshotRefused
from kvfleet.core.block_hash import next_block_hash

SEED = b"fp8-seed"
LAYERS, HEADS, BS, DIM, NUM_BLOCKS = 2, 2, 16, 8, 12
FP = Fingerprint("m", "bfloat16", "fp8_e4m3", BS, LAYERS, HEADS, DIM, "s")


def pool() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYERS, 2, NUM_BLOCKS, HEADS, BS)
    return (torch.zeros(*shape, DIM, dtype=torch.float8_e4m3fn), torch.ones(shape, dtype=torch.float32))


def test_fp8_rows_and_scales_come_back_identical(tmp_path):
    kv, scales = pool()
    generator = torch.Generator().manual_seed(3)
    kv.copy_(torch.randn(kv.shape, generator=generator).to(torch.float8_e4m3fn))
    scales.copy_(torch.rand(scales.shape, generator=generator) + 0.5)
    usage, parent, chain = BlockUsage(), b"", []
    for block_id in (5, 2, 9):  # a three-block prefix, anywhere in the pool
        tokens = list(range(block_id, block_id + BS))
        h = next_block_hash(parent, tokens, b"t", SEED)
        usage.committed(block_id, h, parent, tokens, b"t")
        chain.append((block_id, h))
        parent = h
    path = tmp_path / "snap.safetensors"
    kv_snapshot_io.write(path, kv_snapshot_io.capture(kv, scales, usage, FP, "n0", 10))

    snap = kv_snapshot_io.read(path, FP, SEED)
    new_kv, new_scales = pool()
    allocator = LocalBlockAllocator.standalone(NUM_BLOCKS, BS, 1024)
    new_usage = BlockUsage()
    assert kv_snapshot_io.restore(snap, allocator, new_kv, new_scales, new_usage, NUM_BLOCKS) == 3
    restored = {b.block_hash: b.block_id for b in new_usage.blocks()}
    for old_id, h in chain:
        new_id = restored[h]
        assert torch.equal(new_kv[:, :, new_id].view(torch.uint8), kv[:, :, old_id].view(torch.uint8))
        assert torch.equal(new_scales[:, :, new_id], scales[:, :, old_id])
    assert allocator.stats().num_cached == 3
    assert allocator.allocate("s", "t", [h for _, h in chain], 3 * BS + 1).num_cached_blocks == 3

    with pytest.raises(SnapshotRefused, match="kv_cache_dtype bfloat16 here, fp8_e4m3 in the snapshot"):
        kv_snapshot_io.read(path, Fingerprint("m", "bfloat16", "bfloat16", BS, LAYERS, HEADS, DIM, "s"), SEED)
