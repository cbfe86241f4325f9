"""``BlockAllocator`` for one node, served from an in-process ``PageTable`` (the engine's own)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import Allocation, AllocatorStats, Refusal, TierChange


class LocalBlockAllocator:
    """One node's view of a page table; the engine's in-process allocator."""

    def __init__(self, page_table: PageTable, node_id: str) -> None:
        self.page_table = page_table
        self.node_id = node_id
        self.block_size = page_table.block_size(node_id)
        self.num_blocks = page_table.allocator_stats(node_id).num_blocks
        self._tier_refusals: list[bytes] = []

    @classmethod
    def standalone(
        cls, num_blocks: int, block_size: int, bytes_per_block: int, node_id: str = "local"
    ) -> LocalBlockAllocator:
        """A page table of its own with this one node registered."""
        table = PageTable()
        table.register_node(node_id, num_blocks, block_size, bytes_per_block)
        return cls(table, node_id)

    def allocate(
        self, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int
    ) -> Allocation | Refusal:
        return self.page_table.allocate(self.node_id, seq_id, tenant, block_hashes, num_tokens)

    def extend(self, growth: Sequence[tuple[str, int]]) -> list[list[int] | Refusal]:
        return self.page_table.extend(growth)

    def commit(self, commits: Sequence[tuple[str, int, bytes]]) -> None:
        self.page_table.commit(commits)

    def release(self, seq_ids: Sequence[str]) -> None:
        self.page_table.release(seq_ids)

    def drop_front(self, drops: Sequence[tuple[str, int]]) -> None:
        self.page_table.drop_front(drops)

    def stats(self) -> AllocatorStats:
        return self.page_table.allocator_stats(self.node_id)

    def begin_step(self) -> None:
        """Nothing to batch in process: every call already took effect."""

    def end_step(self) -> None:
        """Nothing to send in process."""

    def record_tiers(self, changes: Sequence[TierChange]) -> None:
        """Applied at once; the hashes the tenant's lower-tier cap refused wait for
        ``take_tier_refusals``."""
        if changes:
            self._tier_refusals += self.page_table.record_tiers(self.node_id, changes).refused

    def take_tier_refusals(self) -> list[bytes]:
        refused, self._tier_refusals = self._tier_refusals, []
        return refused

    def set_tier_source(self, source: Callable[[], list[TierChange]]) -> None:
        """Nothing to re-send: the page table lives in this process and never loses the node."""
