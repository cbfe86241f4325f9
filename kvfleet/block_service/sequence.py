"""A live sequence as the page table holds it: its block table and how many tokens it holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvfleet.core.allocator import DROPPED


@dataclass(slots=True)
class SeqState:
    """A live sequence: its block table and how many tokens the table holds. Entries of blocks
    given back by ``drop_front`` (sliding window) are ``DROPPED``, always a prefix of the table."""

    seq_id: str
    node_id: str
    tenant: str
    block_ids: list[int]
    num_tokens: int
    num_committed: int  # blocks of this table committed (prefix hits included)
    # When this process allocated (or adopted) it, for the top holders' age. Kept in memory only:
    # persisting it would put the wall clock in every allocate record for a diagnostic figure;
    # after a restart the age counts from the recovery and says so (``recovered``).
    since: float = field(default_factory=time.monotonic, compare=False, repr=False)
    recovered: bool = field(default=False, compare=False, repr=False)

    @property
    def held(self) -> list[int]:
        """The blocks the table holds (``DROPPED`` entries left out)."""
        return [b for b in self.block_ids if b != DROPPED]

    @property
    def num_dropped(self) -> int:
        """Leading entries given back (``drop_front``): full blocks, so ``num_dropped * block_size``
        of the sequence's tokens are no longer held."""
        return len(self.block_ids) - len(self.held)

    def to_record(self) -> list:
        """The sequence in a snapshot (``PageTable.to_dict``); ``from_record`` reads it back."""
        return [self.seq_id, self.node_id, self.tenant, list(self.block_ids), self.num_tokens, self.num_committed]

    @classmethod
    def from_record(cls, r: list) -> SeqState:
        seq_id, node_id, tenant, block_ids, num_tokens, num_committed = r
        return cls(seq_id, node_id, tenant, list(block_ids), num_tokens, num_committed)
