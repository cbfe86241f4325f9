"""The engine's in-process allocator speaks ``BlockAllocator`` over one node of the page table."""

from __future__ import annotations

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.core.allocator import Allocation, BlockAllocator, Refusal
from kvfleet.core.block_hash import block_hashes


def test_standalone_allocator_round_trip() -> None:
    alloc: BlockAllocator = LocalBlockAllocator.standalone(num_blocks=4, block_size=16, bytes_per_block=1)
    assert (alloc.block_size, alloc.num_blocks, alloc.stats().num_free) == (16, 4, 4)
    hs = block_hashes(list(range(40)), 16, extra=b"default")
    a = alloc.allocate("r1", "default", hs, 40)
    assert a == Allocation([0, 1, 2], 0)
    alloc.commit([("r1", 0, hs[0]), ("r1", 1, hs[1])])
    a.block_ids.append(99)  # the engine's copy is its own
    assert alloc.page_table.sequence("r1").block_ids == [0, 1, 2]
    assert alloc.extend([("r1", 48)]) == [[]]  # 48 tokens fit the 3 blocks it holds
    assert alloc.extend([("r1", 49)]) == [[3]]  # 49 need the last free block
    assert alloc.page_table.sequence("r1").block_ids == [0, 1, 2, 3]
    assert alloc.stats().num_free == 0
    assert isinstance(alloc.extend([("r1", 80)])[0], Refusal)
    alloc.release(["r1"])
    s = alloc.stats()
    assert (s.num_free, s.num_cached, s.num_used) == (2, 2, 0)
    b = alloc.allocate("r2", "default", hs, 40)
    assert b.num_cached_blocks == 2 and b.block_ids[:2] == [0, 1]
    assert alloc.stats().prefix_hits == 2
    alloc.page_table.check()
