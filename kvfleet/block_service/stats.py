"""Utilisation figures of the page table, per node and per tenant on a node.

Tokens stored against the token capacity of the blocks holding them measures internal
fragmentation: the unused tail of each sequence's last block.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Counters:
    """Events since start (not durable): prefix lookups, refusals, reconciliations, evictions."""

    prefix_queries: int = 0  # block hashes looked up by allocations
    prefix_hits: int = 0     # of those, found committed
    refusals_pool: int = 0
    refusals_quota: int = 0
    reconciled_releases: int = 0  # sequences released because their node no longer listed them
    refusals_lower_tier: int = 0  # demotions refused: the tenant's lower-tier cap was full
    evictions: dict[str, int] = field(default_factory=dict)  # cached blocks evicted, by the policy's reason


@dataclass(slots=True, frozen=True, kw_only=True)
class NodeStats:
    node_id: str
    num_blocks: int
    block_size: int
    bytes_per_block: int
    num_free: int
    num_cached: int
    num_used: int
    num_sequences: int
    tokens_stored: int    # distinct token positions held by used blocks
    token_capacity: int   # num_used * block_size
    counters: Counters = field(default_factory=Counters)
    lower_tier: dict[str, int] = field(default_factory=dict)  # blocks held below the pool, per tier
    transfers_in_flight: int = 0        # KV fetches from peers under way into this pool
    transfer_blocks_in_flight: int = 0  # the blocks they hold meanwhile

    @property
    def utilisation(self) -> float:
        return self.num_used / self.num_blocks

    @property
    def fragmentation(self) -> float:
        """Share of the used blocks' capacity holding no token."""
        return 1 - self.tokens_stored / self.token_capacity if self.token_capacity else 0.0


@dataclass(slots=True, frozen=True, kw_only=True)
class TenantStats:
    tenant: str
    node_id: str
    blocks_charged: int
    blocks_allowed: int | None  # None: unlimited
    blocks_reserved: int
    num_sequences: int
    tokens_stored: int    # sum over the tenant's sequences (shared prefixes counted per sequence)
    token_capacity: int   # sum of their block tables' capacity
    counters: Counters = field(default_factory=Counters)
    lower_tier_blocks: int = 0              # blocks charged to its lower-tier cap on the node
    lower_tier_allowed: int | None = None   # that cap in blocks (None: unlimited)
    cached_blocks: int = 0                  # cached blocks last charged to it (kvfleet.block_service.cache_figures)


@dataclass(slots=True, frozen=True, kw_only=True)
class Holder:
    """A live sequence holding blocks on a node (``kvfleet blocks``' top holders)."""

    seq_id: str
    tenant: str
    num_blocks: int
    num_tokens: int
    tail_waste_tokens: int   # unused slots of its partly filled last block
    age_s: float             # since allocated here (or adopted from its node by a sync)
    age_at_least: bool = False  # allocated before block_service's last start: a lower bound


@dataclass(slots=True, frozen=True, kw_only=True)
class TierBlocks:
    """One tier of a node's KV cache: ``device`` (the pool), and ``host`` and ``disk`` (issue 15:
    committed blocks only, counted as cached; block_service does not know those tiers' sizes)."""

    tier: str
    num_used: int
    num_cached: int
    num_free: int
