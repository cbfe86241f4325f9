"""What the node wrote into each block of its pool, and how often it was reused. Pure Python.

The page table (block_service) knows which blocks are cached, but a node restarting from a KV
snapshot needs more than block ids: the content's name (hash, parent, tokens) and how useful it
has been (prefix hits, recency). ``KVCacheManager`` tells this tracker three things:

    allocate (prefix hit) ──▶ hit(block_ids)            the blocks' content was reused
    allocate / grow        ──▶ overwritten(block_ids)    handed fresh: the engine writes them next
    commit_full_blocks     ──▶ committed(block, ...)     full and written: named by its hash

A block's entry lives from its commit until the block is handed to a sequence fresh (the engine is
the only writer of its pool, and it only writes blocks it was handed), so an entry always names
the bytes in the pool, whether block_service still indexes the block or evicted it meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class CommittedBlock:
    """One full, written block of the pool, named as ``kvfleet.core.block_hash`` names it."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes          # b"" for a sequence's first block
    token_ids: tuple[int, ...]  # the block's tokens (block_size of them)
    extra: bytes                # the first block's extra key (tenant); b"" for the others
    hits: int = 0               # prefix hits on this block since it was written
    last_used: int = 0          # the tracker's clock at its commit or last hit (higher: more recent)
    tenant: str = ""            # the tenant that committed it (a lower tier charges its cap); "" when restored


class BlockUsage:
    def __init__(self) -> None:
        self._blocks: dict[int, CommittedBlock] = {}
        self._by_hash: dict[bytes, int] = {}  # hash -> the block id that last committed it (a peer's fetch)
        self._clock = 0
        self.version = 0  # changes with every change: a periodic snapshot of an unchanged pool is skipped

    def committed(self, block_id: int, block_hash: bytes, parent_hash: bytes, token_ids: Iterable[int],
                  extra: bytes = b"", hits: int = 0, tenant: str = "") -> None:
        self._clock += 1
        self.version += 1
        self._blocks[block_id] = CommittedBlock(block_id, block_hash, parent_hash, tuple(token_ids),
                                                extra if not parent_hash else b"", hits, self._clock, tenant)
        self._by_hash[block_hash] = block_id

    def hit(self, block_ids: Iterable[int], block_hashes: Iterable[bytes]) -> None:
        """Prefix hits: ``block_ids`` were found holding ``block_hashes``. A block this tracker
        names differently (it never saw that commit) is left alone."""
        self._clock += 1
        for block_id, block_hash in zip(block_ids, block_hashes):
            block = self._blocks.get(block_id)
            if block is not None and block.block_hash == block_hash:
                block.hits += 1
                block.last_used = self._clock
                self.version += 1

    def overwritten(self, block_ids: Iterable[int]) -> list[CommittedBlock]:
        """The blocks are handed fresh; what they held (the committed blocks about to be lost from
        the pool: a node with lower tiers demotes them first)."""
        lost = []
        for block_id in block_ids:
            block = self._blocks.pop(block_id, None)
            if block is not None:
                if self._by_hash.get(block.block_hash) == block_id:
                    del self._by_hash[block.block_hash]
                lost.append(block)
                self.version += 1
        return lost

    def blocks(self) -> list[CommittedBlock]:
        """Every block whose content is known, in no particular order (copies: the caller may keep them)."""
        return [_copy(b) for b in self._blocks.values()]

    def find(self, block_hash: bytes) -> CommittedBlock | None:
        """A pool block holding ``block_hash`` (a copy), or None. Two blocks may hold one hash (its
        content computed again after the page table evicted the first): either names the same bytes."""
        block = self._blocks.get(self._by_hash.get(block_hash, -1))
        return _copy(block) if block is not None and block.block_hash == block_hash else None

    def __len__(self) -> int:
        return len(self._blocks)


def _copy(b: CommittedBlock) -> CommittedBlock:
    return CommittedBlock(b.block_id, b.block_hash, b.parent_hash, b.token_ids, b.extra, b.hits, b.last_used, b.tenant)
