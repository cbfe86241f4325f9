"""Named blocks coming into the pool from outside the engine's own forward (a KV snapshot, a peer's
fetched run): the page table's side of it, shared by both. Pure Python: the bytes are written by
the caller's ``write``.

    open_chain    allocate a temporary sequence for the chain's hashes under the paying tenant
                  (quota and pool checked here); its leading blocks the page table already holds
                  come back cached, the rest fresh (what they held is lost: ``hand_fresh``)
    commit_chain  write the fresh blocks, name them (``BlockUsage``), commit them
    release       always, whatever happened between: the blocks stay cached, committed or not

A block is written before its commit names it, so stopping anywhere leaves only true names behind;
an uncommitted fresh block goes back to the free list at release. Everything runs on the engine
thread (the allocator, the usage tracker and the pool are the engine's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvfleet.compute_service.kv.block_usage import BlockUsage, CommittedBlock
from kvfleet.core.allocator import BlockAllocator, Refusal


class NamedBlock(Protocol):
    """A block's name as ``kvfleet.core.block_hash`` computes it (``SnapshotBlock``, a fetched block)."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    extra: bytes
    hits: int


@dataclass(slots=True, frozen=True)
class OpenChain:
    seq_id: str
    block_ids: list[int]   # one per hash of the chain
    num_cached: int        # the leading blocks the pool held already (not to be written)


def open_chain(allocator: BlockAllocator, usage: BlockUsage, seq_id: str, tenant: str, hashes: Sequence[bytes],
               hand_fresh: Callable[[list[CommittedBlock]], None] | None = None) -> OpenChain | Refusal:
    """Blocks for ``hashes`` under ``tenant``; ``hand_fresh`` sees the committed blocks the fresh
    ones held (a node with lower tiers demotes them)."""
    result = allocator.allocate(seq_id, tenant, list(hashes), len(hashes) * allocator.block_size)
    if isinstance(result, Refusal):
        return result
    try:
        lost = usage.overwritten(result.block_ids[result.num_cached_blocks:])
        if lost and hand_fresh is not None:
            hand_fresh(lost)
    except BaseException:
        allocator.release([seq_id])  # the caller never learns of the sequence: it must not outlive this
        raise
    return OpenChain(seq_id, list(result.block_ids), result.num_cached_blocks)


def commit_chain(allocator: BlockAllocator, usage: BlockUsage, chain: OpenChain, blocks: Sequence[NamedBlock],
                 upto: int, write: Callable[[range, list[int]], None], tenant: str = "") -> None:
    """Write blocks ``[chain.num_cached, upto)`` of ``blocks`` (``write(indexes, block_ids)``), then
    name and commit them; ``tenant``: whom the usage tracker records (a lower tier charges it)."""
    fresh = range(chain.num_cached, upto)
    if not fresh:
        return
    dst = [chain.block_ids[i] for i in fresh]
    write(fresh, dst)  # written before it is committed
    for i, block_id in zip(fresh, dst):
        b = blocks[i]
        usage.committed(block_id, b.block_hash, b.parent_hash, b.token_ids, b.extra, b.hits, tenant)
    allocator.commit([(chain.seq_id, i, blocks[i].block_hash) for i in fresh])
