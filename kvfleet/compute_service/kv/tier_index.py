"""The node's lower KV tiers as an index: which committed block lives in which host or disk slot, in
LRU order per tier, and the copies a demotion, a cascade or a swap needs. Pure Python: no torch.

    pool (hot) ──demote──▶ host (cold, LRU) ──cascade when full──▶ disk (LRU) ──full──▶ dropped
        ▲                       │                                    │
        └──────── promote ──────┴────────────────────────────────────┘   (on a prefix hit)

A block is named by its chained hash (``kvfleet.core.block_hash``), so a prefix hit on a demoted block
finds it whatever sequence wrote it. A preempted sequence swapped out is named by its sequence id
instead: its slots (``reserve_swap``) count against the host tier's capacity but are never
cascaded or dropped; hashed blocks make room for them.

Every method answers a ``TierPlan``: the copies to perform, in order (a cascade copies a host
slot to disk before the host slot is written again), and the ``TierChange`` records the page
table is told (``BlockAllocator.record_tiers``). ``kv_tier_store.KVTierStore`` performs the copies.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvfleet.compute_service.kv.tenant_lookups import FetchedBlocks, TenantLookups, counted
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, TierChange

if TYPE_CHECKING:
    from kvfleet.compute_service.engine.sequence import Sequence
    from kvfleet.compute_service.kv.block_usage import CommittedBlock

POOL = "pool"


@dataclass(slots=True, frozen=True)
class Move:
    """Copy one block from ``src_tier``'s slot ``src`` to ``dst_tier``'s slot ``dst`` (tiers: POOL,
    TIER_HOST, TIER_DISK; a pool slot is a block id)."""

    src_tier: str
    src: int
    dst_tier: str
    dst: int


@dataclass(slots=True)
class _Entry:
    slot: int
    tenant: str
    name: CommittedBlock | None = None  # the block as it left the pool (parent, tokens, extra): a peer's fetch


@dataclass(slots=True, frozen=True)
class TierHeld:
    """Where a lower tier holds a hashed block, for whom, and its name when known."""

    tier: str
    slot: int
    tenant: str
    name: CommittedBlock | None


@dataclass(slots=True, frozen=True)
class TierCounts:
    host_blocks: int      # capacity of the host tier, in blocks (swapped sequences' blocks included)
    disk_blocks: int      # capacity of the disk tier
    host_used: int        # hashed blocks held in host
    disk_used: int        # hashed blocks held on disk
    swapped: int          # host slots holding swapped-out sequences' blocks


@dataclass(slots=True)
class TierPlan:
    """The copies a change of the tiers needs, in order, and the records for the page table."""

    moves: list[Move] = field(default_factory=list)
    changes: list[TierChange] = field(default_factory=list)

    def extend(self, other: TierPlan) -> None:
        self.moves.extend(other.moves)
        self.changes.extend(other.changes)


class TierIndex:
    def __init__(self, host_blocks: int, disk_blocks: int = 0) -> None:
        if host_blocks < 0 or disk_blocks < 0:
            raise ValueError(f"tier capacities must be >= 0 blocks, got host {host_blocks}, disk {disk_blocks}")
        self.host_blocks, self.disk_blocks = host_blocks, disk_blocks
        self._tiers: dict[str, OrderedDict[bytes, _Entry]] = {TIER_HOST: OrderedDict(), TIER_DISK: OrderedDict()}
        self._free: dict[str, list[int]] = {TIER_HOST: list(range(host_blocks - 1, -1, -1)),
                                            TIER_DISK: list(range(disk_blocks - 1, -1, -1))}
        self._swaps: dict[str, list[int]] = {}

    # -- hashed blocks ----------------------------------------------------------------------------

    def where(self, block_hash: bytes) -> tuple[str, int] | None:
        """``(tier, slot)`` holding ``block_hash``, or None."""
        for tier, held in self._tiers.items():
            entry = held.get(block_hash)
            if entry is not None:
                return tier, entry.slot
        return None

    def held(self, block_hash: bytes) -> TierHeld | None:
        for tier, held in self._tiers.items():
            entry = held.get(block_hash)
            if entry is not None:
                return TierHeld(tier, entry.slot, entry.tenant, entry.name)
        return None

    def run(self, block_hashes: list[bytes]) -> list[tuple[str, int]]:
        """Where the leading blocks of ``block_hashes`` are held, up to the first one that is not."""
        found: list[tuple[str, int]] = []
        for block_hash in block_hashes:
            place = self.where(block_hash)
            if place is None:
                break
            found.append(place)
        return found

    def demote(self, block_hash: bytes, tenant: str, pool_block: int, name: CommittedBlock | None = None) -> TierPlan:
        """Keep pool block ``pool_block`` (holding ``block_hash``) in host before the pool reuses it.
        A block already held in a lower tier is only made most recent; without a host tier, or with
        every host slot swapped out, nothing is kept (the block is lost, as without tiers)."""
        plan = TierPlan()
        for held in self._tiers.values():
            if block_hash in held:
                held.move_to_end(block_hash)
                return plan
        slot = self._host_slot(plan)
        if slot is None:
            return plan
        self._tiers[TIER_HOST][block_hash] = _Entry(slot, tenant, name)
        plan.moves.append(Move(POOL, pool_block, TIER_HOST, slot))
        plan.changes.append(TierChange(block_hash, tenant, TIER_HOST))
        return plan

    def take(self, block_hash: bytes) -> TierChange | None:
        """Forget ``block_hash`` (promoted into the pool, or found unreadable) and free its slot; the
        record telling the page table the node holds it in no lower tier any more."""
        for tier, held in self._tiers.items():
            entry = held.pop(block_hash, None)
            if entry is not None:
                self._free[tier].append(entry.slot)
                return TierChange(block_hash, entry.tenant, TIER_NONE)
        return None

    def refused(self, block_hashes: list[bytes]) -> int:
        """The page table refused these blocks (the tenant's lower-tier cap): drop them without a
        record (it already holds none). How many were held."""
        return sum(self.take(h) is not None for h in block_hashes)

    def disable_disk(self) -> list[TierChange]:
        """The disk tier failed (full, unwritable): drop what it holds and use it no more."""
        changes = [self.take(h) for h in list(self._tiers[TIER_DISK])]
        self.disk_blocks = 0
        self._free[TIER_DISK] = []
        return [c for c in changes if c is not None]

    def entries(self) -> list[TierChange]:
        """Every hashed block held, as the records that would tell a fresh page table of them."""
        return [TierChange(h, e.tenant, tier) for tier, held in self._tiers.items() for h, e in held.items()]

    # -- swapped sequences ------------------------------------------------------------------------

    def reserve_swap(self, seq_id: str, num_blocks: int) -> tuple[list[int], TierPlan] | None:
        """Host slots for a preempted sequence's ``num_blocks`` blocks, cascading or dropping hashed
        blocks to make room; None when swapped sequences already hold too much of the host tier."""
        if seq_id in self._swaps or num_blocks > self.host_blocks - self.swapped_blocks():
            return None
        plan, slots = TierPlan(), []
        for _ in range(num_blocks):
            slot = self._host_slot(plan)
            assert slot is not None, "room was counted above"
            slots.append(slot)
        self._swaps[seq_id] = slots
        return slots, plan

    def swap_slots(self, seq_id: str) -> list[int] | None:
        return self._swaps.get(seq_id)

    def release_swap(self, seq_id: str) -> None:
        """The sequence was swapped back in (or finished while out): its slots are free."""
        self._free[TIER_HOST].extend(self._swaps.pop(seq_id, []))

    def swapped_blocks(self) -> int:
        return sum(len(slots) for slots in self._swaps.values())

    def counts(self) -> TierCounts:
        return TierCounts(self.host_blocks, self.disk_blocks, len(self._tiers[TIER_HOST]),
                          len(self._tiers[TIER_DISK]), self.swapped_blocks())

    # -- internals --------------------------------------------------------------------------------

    def _host_slot(self, plan: TierPlan) -> int | None:
        return self._slot(TIER_HOST, plan)

    def _slot(self, tier: str, plan: TierPlan) -> int | None:
        """A free slot of ``tier``; when none, its least recent hashed block leaves: from host down
        to disk (whose own least recent block may leave first), from disk (or a host without
        disk) dropped. None when the tier holds no hashed block (empty, or all swapped)."""
        if self._free[tier]:
            return self._free[tier].pop()
        held = self._tiers[tier]
        if not held:
            return None
        block_hash, entry = held.popitem(last=False)
        below = self._slot(TIER_DISK, plan) if tier == TIER_HOST else None
        if below is None:
            plan.changes.append(TierChange(block_hash, entry.tenant, TIER_NONE))
        else:
            self._tiers[TIER_DISK][block_hash] = _Entry(below, entry.tenant, entry.name)
            plan.moves.append(Move(TIER_HOST, entry.slot, TIER_DISK, below))
            plan.changes.append(TierChange(block_hash, entry.tenant, TIER_DISK))
        return entry.slot


@dataclass(slots=True)
class PrefixLookups:
    """Blocks looked up at admission, by where they were found: the pool (hot), a lower tier
    (promoted instead of recomputed), or nowhere (computed); and the same per tenant, with the
    pool's hits that a peer fetch brought told apart (``tenant_lookups.py``). A copy
    (``dataclasses.replace``) shares ``by_tenant``, which is replaced, never changed."""

    hot: int = 0
    host: int = 0
    disk: int = 0
    miss: int = 0
    by_tenant: Mapping[str, TenantLookups] = field(default_factory=dict)
    fetched: FetchedBlocks = field(default_factory=FetchedBlocks, init=False, repr=False, compare=False)

    def add(self, hot: int, found: list[str], looked_up: int, tenant: str = "",
            hot_hashes: list[bytes] | None = None) -> None:
        self.hot += hot
        self.host += found.count(TIER_HOST)
        self.disk += found.count(TIER_DISK)
        self.miss += looked_up - hot - len(found)
        if tenant:
            self.by_tenant = counted(self.by_tenant, tenant, looked_up, hot_hashes or [], found, self.fetched)


class LowerTiers(Protocol):
    """What ``KVCacheManager`` asks of the node's lower tiers (``kv_tier_store.KVTierStore``)."""

    def demote(self, blocks: list[CommittedBlock]) -> None: ...

    def promote(self, block_hashes: list[bytes], block_ids: list[int]) -> list[str]: ...

    def swap_out(self, seq: Sequence) -> bool: ...

    def is_swapped(self, seq_id: str) -> bool: ...

    def swap_in(self, seq: Sequence, cached_blocks: int) -> int: ...

    def forget(self, seq_id: str) -> None: ...
