"""The narrow interface between an engine and the page table.

The engine (compute_service) speaks only this interface. ``LocalBlockAllocator`` serves it from the
in-process core (one node of ``kvfleet.block_service.page_table.PageTable``); the cluster serves it over gRPC
from kvfleet.block_service. Full pools and exhausted quotas are answers (``Refusal``), never exceptions; so
is block_service being unreachable (a transient refusal: try again later, nothing is wrong with the
request or the pool).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

UNAVAILABLE = "unavailable"  # a refusal's reason when block_service did not answer
# A block-table entry given back by ``drop_front``: outside every pool (and a valid uint32 on the wire
# and in the log), so that a table keeps its positions (entry i holds tokens i*bs .. (i+1)*bs - 1).
DROPPED = 0xFFFFFFFF


@dataclass(slots=True, frozen=True)
class Refusal:
    """Why blocks were not granted: ``reason`` is ``"pool"`` (node full), ``"quota"`` (tenant) or
    ``"unavailable"`` (block_service unreachable: transient, neither the pool's nor the tenant's
    answer; the engine tries again later instead of preempting or refusing anything)."""

    reason: str
    node_id: str
    tenant: str
    blocks_asked: int
    blocks_charged: int
    blocks_allowed: int

    @classmethod
    def unavailable(cls, node_id: str, tenant: str = "", blocks_asked: int = 0) -> Refusal:
        return cls(UNAVAILABLE, node_id, tenant, blocks_asked, 0, 0)

    @property
    def transient(self) -> bool:
        """True when asking again later may succeed with nothing else changed."""
        return self.reason == UNAVAILABLE

    def message(self) -> str:
        if self.transient:
            return f"block_service is unreachable from node {self.node_id}; blocks cannot be granted until it answers"
        if self.reason == "quota":
            return (
                f"tenant {self.tenant!r} KV quota exhausted on node {self.node_id}: asked "
                f"{self.blocks_asked} blocks, {self.blocks_charged} charged of {self.blocks_allowed} allowed"
            )
        return (
            f"block pool exhausted on node {self.node_id} for tenant {self.tenant!r}: asked "
            f"{self.blocks_asked} blocks, {self.blocks_charged} in use of {self.blocks_allowed}"
        )


@dataclass(slots=True, frozen=True)
class AllocateRequest:
    """One sequence's first allocation, as a node asks for it (``BlockAllocator.allocate``'s arguments)."""

    node_id: str
    seq_id: str
    tenant: str
    block_hashes: Sequence[bytes]
    num_tokens: int


@dataclass(slots=True)
class Allocation:
    """A sequence's block table after allocation.

    ``block_ids[:num_cached_blocks]`` came from the prefix cache: their KV is already written.
    """

    block_ids: list[int]
    num_cached_blocks: int


@dataclass(slots=True, frozen=True)
class LiveSequence:
    """One live sequence as its node holds it (its whole table: handed blocks and reserve): what a
    node lists in a sync and what block_service compares with its own view of that node."""

    seq_id: str
    tenant: str
    block_ids: tuple[int, ...]
    num_tokens: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_ids", tuple(self.block_ids))  # compared, never changed


@dataclass(slots=True, frozen=True)
class AllocatorStats:
    num_blocks: int
    num_free: int          # never used or evicted: holds nothing
    num_cached: int        # unreferenced but committed: reusable by prefix, evictable (LRU)
    num_used: int          # referenced by at least one live sequence
    prefix_queries: int    # blocks looked up in the prefix index
    prefix_hits: int       # of those, found committed


# Lower tiers of a node's KV cache: the device pool is hot; below it a host-memory pool and
# a disk directory hold committed blocks demoted instead of evicted.
TIER_HOST = "host"
TIER_DISK = "disk"
TIER_NONE = ""  # in no lower tier of the node (promoted back into the pool, or dropped)


@dataclass(slots=True, frozen=True)
class TierChange:
    """A committed block of this node moved between its lower tiers.

    ``tier`` is ``TIER_HOST`` or ``TIER_DISK`` when the node now holds the block's KV there (demoted
    from the pool when block_service reused its pool block, or moved from host to disk), and
    ``TIER_NONE`` when the node holds it in no lower tier any more (promoted back into the pool, where
    its commit makes it hot again, or dropped). ``tenant`` is the tenant whose lower-tier cap the block
    is charged to (the tenant that committed it).
    """

    block_hash: bytes
    tenant: str
    tier: str


class BlockAllocator(Protocol):
    """What an engine needs from the page table of its node."""

    block_size: int
    num_blocks: int

    def allocate(
        self, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int
    ) -> Allocation | Refusal:
        """Give ``seq_id`` blocks for ``num_tokens`` tokens, reusing the longest committed prefix of
        ``block_hashes`` (the hashes of the full blocks the engine is willing to reuse)."""

    def extend(self, growth: Sequence[tuple[str, int]]) -> list[list[int] | Refusal]:
        """Grow each ``(seq_id, num_tokens)`` to hold ``num_tokens`` tokens; per sequence, the newly
        appended block ids (possibly none) or a refusal (that sequence unchanged)."""

    def commit(self, commits: Sequence[tuple[str, int, bytes]]) -> None:
        """Mark ``(seq_id, block_index, block_hash)`` full and written: findable by prefix lookups."""

    def release(self, seq_ids: Sequence[str]) -> None:
        """Drop the sequences; their committed blocks stay cached (deepest evicted first)."""

    def drop_front(self, drops: Sequence[tuple[str, int]]) -> None:
        """Per ``(seq_id, num_blocks)``: the sequence no longer needs blocks ``[0, num_blocks)`` of its
        table (a sliding-window model: they hold only keys outside every layer's window). They are
        given back as a release gives blocks back (committed ones stay cached); the table keeps its
        positions, those entries becoming ``DROPPED``. ``num_blocks`` counts from the table's start,
        so sending it again changes nothing; only full blocks can be dropped."""

    def stats(self) -> AllocatorStats:
        """Current figures of this node's pool."""

    def begin_step(self) -> None:
        """The engine starts a step (schedule, forward, sample)."""

    def end_step(self) -> None:
        """The engine finished a step: a remote allocator sends its queued deltas now, off the
        critical path of the next forward pass."""

    def record_tiers(self, changes: Sequence[TierChange]) -> None:
        """Tell the page table which committed blocks this node holds in which lower tier (queued and
        sent with the step's other deltas by a remote allocator), so that prefix lookups and routing
        value a lower-tier hit above a miss and below a hot one, and the tenant's lower-tier cap is
        charged."""

    def take_tier_refusals(self) -> list[bytes]:
        """Hashes whose move into a lower tier the page table refused since the last call (the tenant's
        lower-tier cap is full): the node drops its copies of them."""

    def set_tier_source(self, source: Callable[[], list[TierChange]]) -> None:
        """Where the node's whole lower-tier index can be read: a remote allocator re-sends it when it
        registers or re-registers with block_service, and with each reconciliation, replacing what
        block_service held for the node."""
