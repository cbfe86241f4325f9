"""The tier store over real pool tensors (no model): FP8 rows and their scales survive demotion,
the host -> disk cascade and promotion bit for bit; a disk that fails is dropped, not served."""

from __future__ import annotations

import shutil

import torch

from kvfleet.compute_service.kv.block_usage import CommittedBlock
from kvfleet.compute_service.kv.tier_store import KVTierStore
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE

LAYERS, HEADS, BS, DIM, NUM_BLOCKS = 2, 2, 16, 8, 6


def fp8_pool() -> tuple[torch.Tensor, torch.Tensor]:
    shape = (LAYERS, 2, NUM_BLOCKS, HEADS, BS)
    generator = torch.Generator().manual_seed(5)
    kv = torch.randn(*shape, DIM, generator=generator).to(torch.float8_e4m3fn)
    return kv, torch.rand(shape, generator=generator) + 0.5


def committed(block_id: int) -> CommittedBlock:
    return CommittedBlock(block_id, bytes([block_id]) * 8, b"", tuple(range(BS)), b"", tenant="t")


def block(kv: torch.Tensor, scales: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv[:, :, block_id].view(torch.uint8).clone(), scales[:, :, block_id].clone()


def test_fp8_blocks_and_scales_come_back_identical_from_host_and_disk(tmp_path):
    kv, scales = fp8_pool()
    records = []
    store = KVTierStore(kv, scales, BS, host_blocks=1, record=records.extend, disk_dir=str(tmp_path),
                        disk_blocks=4)
    before = {b: block(kv, scales, b) for b in (1, 4)}
    store.demote([committed(1)])
    store.demote([committed(4)])  # host holds one: block 1 cascades to disk
    assert [(r.tier) for r in records] == [TIER_HOST, TIER_DISK, TIER_HOST]
    kv.zero_()
    scales.fill_(1.0)
    found = store.promote([committed(1).block_hash, committed(4).block_hash], [0, 5])
    assert found == [TIER_DISK, TIER_HOST]
    for src, dst in ((1, 0), (4, 5)):
        got = block(kv, scales, dst)
        assert torch.equal(got[0], before[src][0]) and torch.equal(got[1], before[src][1])
    assert [r.tier for r in records[-2:]] == [TIER_NONE, TIER_NONE]
    assert store.entries() == []


def test_a_disk_that_cannot_be_written_is_dropped_with_its_blocks(tmp_path, caplog):
    kv, scales = fp8_pool()
    records = []
    disk = tmp_path / "kv"
    store = KVTierStore(kv, scales, BS, host_blocks=1, record=records.extend, disk_dir=str(disk), disk_blocks=4)
    shutil.rmtree(disk)
    disk.write_text("not a directory any more")
    store.demote([committed(1)])
    store.demote([committed(2)])  # cascading block 1 fails: the disk tier is given up
    h1, h2 = committed(1).block_hash, committed(2).block_hash
    assert [(r.block_hash, r.tier) for r in records] == [(h1, TIER_HOST), (h1, TIER_DISK), (h2, TIER_HOST),
                                                         (h1, TIER_NONE)]
    assert store.counts().disk_blocks == 0 and store.counts().disk_used == 0
    assert store.promote([h1], [0]) == []  # dropped, never served
    assert store.promote([h2], [0]) == [TIER_HOST]
    assert sum("KV disk tier disabled" in r.getMessage() for r in caplog.records) == 1
