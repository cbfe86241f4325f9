"""The fleet's page table: every node's block pool, every live sequence, every tenant's quota.

Three layers, one job each: ``BlockPool`` owns one node's block metadata (free list, cached LRU,
reference counts, its part of the prefix index); ``QuotaLedger`` owns one node's charges per tenant;
``PageTable`` gives the per-sequence API over all nodes and keeps the block tables and the one
``PrefixIndex`` (block hash → the nodes holding it) the pools share, so that ``match_prefix`` costs
the same whatever the number of nodes holding the prefix. Every call validates its whole
batch before changing anything, so an exception leaves the state untouched; a full pool or quota is
an answer (``Refusal``). The page table is deterministic, which the write-ahead log relies on:
replaying the same calls on the same state gives the same block ids.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from block_service.block_pool import BlockPool, validate_shape
from block_service.lower_tiers import LowerTiers, TierOutcome, validate_tier_change
from block_service.node_state import NodeState
from block_service.node_sync import LiveSequence, SyncResult, plan_sync
from block_service.pool_codec import pool_from_dict, pool_to_dict
from block_service.prefix_index import MAX_SLOTS, PrefixIndex
from block_service.stats import Counters, Holder, NodeStats, TenantStats
from block_service.tenants import QuotaLedger, tenant_from_record, tenant_to_record
from block_service.validation import validate_hashes, validate_tokens
from kvfleet.allocator import DROPPED, AllocateRequest, Allocation, AllocatorStats, Refusal, TierChange
from kvfleet.block_hash import HASH_BYTES
from kvfleet.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from kvfleet.ids import check_id
from kvfleet.tenants import Tenant

log = logging.getLogger(__name__)



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


class PageTable:
    def __init__(self) -> None:
        self._nodes: dict[str, NodeState] = {}
        self._seqs: dict[str, SeqState] = {}
        self._tenants: dict[str, Tenant] = {}
        self._index = PrefixIndex()
        self._tiers = LowerTiers()  # what each node holds below its pool (issue 15)
        self._free_slots: list[int] = []  # heap: a removed node's slot goes to the next new node

    # ---- nodes and tenants ---------------------------------------------------------------------

    def register_node(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int) -> bool:
        """Add a node's pool; True if new. Registering the same shape again is a no-op."""
        check_id("node_id", node_id)
        node = self._nodes.get(node_id)
        if node is not None:
            p = node.pool
            if (p.num_blocks, p.block_size, p.bytes_per_block) == (num_blocks, block_size, bytes_per_block):
                return False
            raise AlreadyExists(
                f"node {node_id!r} is registered with {p.num_blocks} blocks of {p.block_size} tokens, "
                f"{p.bytes_per_block} bytes; deregister it first to change its pool"
            )
        validate_shape(num_blocks, block_size, bytes_per_block)
        ledger = QuotaLedger(bytes_per_block)
        pool = BlockPool(num_blocks, block_size, bytes_per_block, self._index, self._take_slot())
        node = NodeState(pool, ledger)
        ledger.configure(self._tenants.values())
        self._nodes[node_id] = node
        return True

    def deregister_node(self, node_id: str) -> list[str]:
        """Drop a node and release all its sequences; returns their ids."""
        node = self._node(node_id)
        released = list(node.seq_ids)
        self._release(released)
        node.pool.unindex_all()
        self._tiers.drop(node.pool.slot)
        heapq.heappush(self._free_slots, node.pool.slot)
        del self._nodes[node_id]
        return released

    def _take_slot(self) -> int:
        """The smallest slot no node holds (slots are the nodes' bits in the prefix index)."""
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        if len(self._nodes) >= MAX_SLOTS:
            raise FailedPrecondition(f"a page table holds at most {MAX_SLOTS} nodes")
        return len(self._nodes)

    def sync_node(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int,
                  listed: Sequence[LiveSequence]) -> SyncResult:
        """Make this table's view of a node equal to the node's own account (``node_sync``): register
        its pool (a new shape replaces the old one, releasing everything on it), release what it no
        longer holds, take the tables of the sequences it lists; refuse what cannot be true."""
        check_id("node_id", node_id)
        validate_shape(num_blocks, block_size, bytes_per_block)
        result = SyncResult()
        node = self._nodes.get(node_id)
        if node is not None and (node.pool.num_blocks, node.pool.block_size, node.pool.bytes_per_block) != (
            num_blocks, block_size, bytes_per_block
        ):
            result.released = self.deregister_node(node_id)
        result.registered = self.register_node(node_id, num_blocks, block_size, bytes_per_block)
        node = self._nodes[node_id]
        plan = plan_sync(node_id, num_blocks, block_size, listed, node.seq_ids, self._live)
        self._release(plan.release)
        result.released += plan.release
        result.refused, result.listed = plan.refused, plan.listed
        owners = node.pool.claim([([b for b in s.block_ids if b != DROPPED], s.tenant) for s in plan.take])
        for t, n in owners.items():
            node.ledger.charge_granted(t, n)
        for s in plan.take:
            old = self._seqs.get(s.seq_id)
            (result.adopted if old is None else result.updated).append(s.seq_id)
            if old is not None:
                self._unreference(node, old.held)
            num_committed = sum(1 for b in s.block_ids if b != DROPPED and node.pool.hash[b] is not None)
            self._seqs[s.seq_id] = SeqState(s.seq_id, node_id, s.tenant, list(s.block_ids), s.num_tokens,
                                            num_committed)
            node.seq_ids[s.seq_id] = None
        if result.released:
            node.counters.reconciled_releases += len(result.released)
            log.info("sync of node %s: released %d sequences the node no longer holds", node_id,
                     len(result.released))
        return result

    def _tenant_seqs(self, node: NodeState) -> dict[str, int]:
        """Live sequences per tenant on ``node`` (for the pool-exhausted warning)."""
        per: dict[str, int] = {}
        for seq_id in node.seq_ids:
            t = self._seqs[seq_id].tenant
            per[t] = per.get(t, 0) + 1
        return per

    def _live(self, seq_id: str) -> tuple[str, LiveSequence] | None:
        s = self._seqs.get(seq_id)
        return None if s is None else (s.node_id, LiveSequence(s.seq_id, s.tenant, s.block_ids, s.num_tokens))

    def configure_tenants(self, configs: Iterable[Tenant], replace_all: bool = False) -> None:
        """Add or update tenants (``replace_all``: the given list is the whole set); API keys are
        dropped: block_service never holds them."""
        configs = [c.without_key() for c in configs]
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise InvalidArgument("a tenant appears twice in one configuration")
        tenants = {} if replace_all else dict(self._tenants)
        tenants.update((c.name, c) for c in configs)
        self._tenants = tenants
        for node in self._nodes.values():
            node.ledger.configure(tenants.values())

    def node_ids(self) -> list[str]:
        return list(self._nodes)

    def tenants(self) -> list[Tenant]:
        return list(self._tenants.values())

    def block_size(self, node_id: str) -> int:
        return self._node(node_id).pool.block_size

    def sequence(self, seq_id: str) -> SeqState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown sequence {seq_id!r}")
        return replace(seq, block_ids=list(seq.block_ids))

    def num_available(self, node_id: str, tenant: str | None = None) -> int:
        """Blocks an allocation could take now (for ``tenant``: less what others have reserved)."""
        node = self._node(node_id)
        avail = node.pool.num_available()
        return avail - node.ledger.reserved_for_others(tenant) if tenant else avail

    # ---- sequences -----------------------------------------------------------------------------

    def allocate(
        self, node_id: str, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int
    ) -> Allocation | Refusal:
        return self.allocate_many([AllocateRequest(node_id, seq_id, tenant, block_hashes, num_tokens)])[0]

    def allocate_many(self, requests: Sequence[AllocateRequest]) -> list[Allocation | Refusal]:
        """Per request, the new block table (longest committed prefix reused) or a refusal."""
        seen: set[str] = set()
        for r in requests:
            self._node(r.node_id)
            check_id("seq_id", r.seq_id)
            if r.seq_id in self._seqs or r.seq_id in seen:
                raise AlreadyExists(f"sequence {r.seq_id!r} is already live")
            seen.add(r.seq_id)
            check_id("tenant", r.tenant)
            validate_tokens(r.num_tokens)
            validate_hashes(r.block_hashes)
        return [self._allocate(r) for r in requests]

    def _allocate(self, r: AllocateRequest) -> Allocation | Refusal:
        node = self._nodes[r.node_id]
        pool, tenant = node.pool, r.tenant
        bs = pool.block_size
        hashes = r.block_hashes[: r.num_tokens // bs]  # only full blocks are shared
        hits = pool.lookup(hashes)
        num_fresh = -(-r.num_tokens // bs) - len(hits)
        refusal = node.refusal(r.node_id, tenant, pool.num_revivable(hits) + num_fresh, self._tenant_seqs)
        if refusal is not None:
            return refusal
        revived = pool.acquire(hits, tenant)
        block_ids = hits + pool.take(num_fresh, tenant)
        node.ledger.charge(tenant, revived + num_fresh)
        self._seqs[r.seq_id] = SeqState(r.seq_id, r.node_id, tenant, block_ids, r.num_tokens, len(hits))
        node.seq_ids[r.seq_id] = None
        for c in (node.counters, node.tenant_counter(tenant)):
            c.prefix_queries += len(hashes)
            c.prefix_hits += len(hits)
        return Allocation(list(block_ids), len(hits))  # the caller's copy: it may append to it

    def extend(self, growth: Sequence[tuple[str, int]], tenant: str | None = None) -> list[list[int] | Refusal]:
        """Grow each ``(seq_id, num_tokens)``; per sequence the new block ids or a refusal."""
        seqs = self._lookup([s for s, _ in growth], tenant)
        for seq, (_, n) in zip(seqs, growth):
            if validate_tokens(n) < seq.num_tokens:
                raise InvalidArgument(
                    f"sequence {seq.seq_id!r} holds {seq.num_tokens} tokens; extend cannot shrink it to {n}"
                )
        results: list[list[int] | Refusal] = []
        for seq, (_, n) in zip(seqs, growth):
            node = self._nodes[seq.node_id]
            need = -(-n // node.pool.block_size) - len(seq.block_ids)
            refusal = node.refusal(seq.node_id, seq.tenant, need, self._tenant_seqs) if need else None
            if refusal is not None:
                results.append(refusal)
                continue
            fresh = node.pool.take(need, seq.tenant)
            node.ledger.charge(seq.tenant, need)
            seq.block_ids += fresh
            seq.num_tokens = n
            results.append(fresh)
        return results

    def commit(self, commits: Sequence[tuple[str, int, bytes]], tenant: str | None = None) -> int:
        """Name full, written blocks by hash (findable from now on); returns how many were new.

        A commit declares its block full: the node wrote it, and only the node knows. When the
        sequence's length here ends inside that block (a reserve top-up was refused, so the
        length stayed where the prompt or an exact growth left it), the length grows to the
        block's end. That is never a new block, so no quota is involved; refusing it instead
        lost the prefix hit of a block the engine had filled."""
        seqs = self._lookup([s for s, _, _ in commits], tenant, unique=False)
        pending: dict[tuple[str, int], bytes] = {}
        for seq, (_, i, h) in zip(seqs, commits):
            if type(h) is not bytes or len(h) != HASH_BYTES:
                validate_hashes([h])  # raises, saying why
            if not isinstance(i, int) or not 0 <= i < len(seq.block_ids):
                raise InvalidArgument(
                    f"sequence {seq.seq_id!r} holds {len(seq.block_ids)} blocks: block {i!r} is not one of them"
                )
            b = seq.block_ids[i]
            if b == DROPPED:
                raise FailedPrecondition(f"block {i} of sequence {seq.seq_id!r} was given back (drop_front)")
            old = self._nodes[seq.node_id].pool.hash[b]
            if pending.setdefault((seq.node_id, b), h) != h:
                raise InvalidArgument(f"block {i} of sequence {seq.seq_id!r} committed twice, two hashes")
            if old not in (None, h):
                raise FailedPrecondition(
                    f"block {i} of sequence {seq.seq_id!r} is already committed with hash {old.hex()}"
                )
        num_new = 0
        for seq, (_, i, h) in zip(seqs, commits):
            pool = self._nodes[seq.node_id].pool
            seq.num_tokens = max(seq.num_tokens, (i + 1) * pool.block_size)
            if pool.commit(seq.block_ids[i], h):
                seq.num_committed += 1
                num_new += 1
        return num_new

    def release(self, seq_ids: Sequence[str], tenant: str | None = None) -> None:
        """Drop the sequences; each table is released deepest block first, so that the deepest
        block of a prefix is the least recently used one and the first evicted."""
        self._lookup(seq_ids, tenant)
        self._release(seq_ids)

    def _release(self, seq_ids: Iterable[str]) -> None:
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id)
            node = self._nodes[seq.node_id]
            del node.seq_ids[seq_id]
            self._unreference(node, seq.held)

    def drop_front(self, drops: Sequence[tuple[str, int]], tenant: str | None = None) -> None:
        """Give back blocks ``[0, n)`` of each ``(seq_id, n)`` (``BlockAllocator.drop_front``): a
        sliding-window sequence's blocks outside every layer's window. Like a release, deepest
        first, committed blocks to the prefix cache; the table keeps its positions (``DROPPED``).
        The whole batch is validated first; ``n`` at or below what was dropped changes nothing."""
        seqs = self._lookup([s for s, _ in drops], tenant)
        for seq, (_, n) in zip(seqs, drops):
            bs = self._nodes[seq.node_id].pool.block_size
            if not isinstance(n, int) or isinstance(n, bool) or n < 0 or n * bs > seq.num_tokens:
                raise InvalidArgument(
                    f"sequence {seq.seq_id!r} has {seq.num_tokens} tokens in blocks of {bs}: cannot drop "
                    f"its first {n!r} blocks (only full blocks can be dropped)")
        for seq, (_, n) in zip(seqs, drops):
            gone = [b for b in seq.block_ids[:n] if b != DROPPED]
            if not gone:
                continue
            seq.block_ids[:n] = [DROPPED] * n
            self._unreference(self._nodes[seq.node_id], gone)

    @staticmethod
    def _unreference(node: NodeState, block_ids: list[int]) -> None:
        """Give a table's blocks back, deepest first, and uncharge those no table holds any more."""
        uncharged: dict[str, int] = {}
        node.pool.release(block_ids[::-1], uncharged)
        for t, n in uncharged.items():
            node.ledger.uncharge(t, n)

    def match_prefix(self, block_hashes: Sequence[bytes], node_ids: Sequence[str] | None = None) -> dict[str, int]:
        """Per node, how many leading blocks of the prompt are committed there. Changes nothing."""
        return self.match_tiers(block_hashes, node_ids)[0]

    def match_tiers(self, block_hashes: Sequence[bytes],
                    node_ids: Sequence[str] | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """``(hot, lower)``: per node (every node, or those named) how many leading blocks of the
        prompt are committed in its pool, and for the nodes holding any, how many blocks past those
        it holds in a lower tier (``LowerTiers.match``). Changes nothing. ``lower`` is sparse and
        costs nothing while no node holds a lower tier: the fleet-scale lookup stays as it was."""
        validate_hashes(block_hashes)
        nodes = [(n, self._node(n)) for n in node_ids] if node_ids else self._nodes.items()
        depth = self._index.match(block_hashes)
        hot = {n: depth.get(node.pool.slot, 0) for n, node in nodes}
        if self._tiers.empty:
            return hot, {}
        among = None
        if node_ids:
            among = 0
            for _, node in nodes:
                among |= 1 << node.pool.slot
        by_slot = self._tiers.match(block_hashes, self._index, depth, among)
        return hot, {n: by_slot[node.pool.slot] for n, node in nodes if node.pool.slot in by_slot} if by_slot else {}

    # ---- lower tiers (issue 15) ----------------------------------------------------------------

    def record_tiers(self, node_id: str, changes: Sequence[TierChange]) -> TierOutcome:
        """The node moved these committed blocks between its lower tiers (``TierChange``), in order.
        The batch is validated first (a bad change raises, nothing applied); a demotion past the
        tenant's lower-tier cap is refused alone (``TierOutcome.refused``: the node drops it)."""
        node = self._node(node_id)
        for c in changes:
            validate_tier_change(c)
        out = self._tiers.apply(node.pool.slot, changes, self._lower_caps(node))
        for t in out.refused_tenants:
            for c in (node.counters, node.tenant_counter(t)):
                c.refusals_lower_tier += 1
        return out

    def replace_tiers(self, node_id: str, held: Sequence[TierChange]) -> bool:
        """The node's whole lower-tier index is ``held`` (its own account, at a sync); True if
        that changed what this table had. Taken above a cap too: the node holds them already."""
        node = self._node(node_id)
        for c in held:
            validate_tier_change(c, replacing=True)
        return self._tiers.replace(node.pool.slot, held)

    def lower_tiers(self, node_id: str) -> list[TierChange]:
        """What the node holds below its pool, as this table knows it."""
        tiers = self._tiers.node(self._node(node_id).pool.slot)
        return tiers.changes() if tiers is not None else []

    def _lower_caps(self, node: NodeState) -> dict[str, int]:
        bpb = node.pool.bytes_per_block
        caps = {}
        for t in self._tenants.values():
            q = t.lower_tier_quota_blocks(bpb)
            if q is not None:
                caps[t.name] = q
        return caps

    # ---- helpers -------------------------------------------------------------------------------

    def _node(self, node_id: str) -> NodeState:
        node = self._nodes.get(node_id)
        if node is None:
            raise NotFound(f"unknown node {node_id!r}")
        return node

    def _lookup(self, seq_ids: Sequence[str], tenant: str | None, unique: bool = True) -> list[SeqState]:
        seqs = []
        for seq_id in seq_ids:
            seq = self._seqs.get(seq_id)
            if seq is None:
                raise NotFound(f"unknown sequence {seq_id!r}")
            if tenant is not None and seq.tenant != tenant:
                raise PermissionDenied(f"sequence {seq_id!r} belongs to another tenant than {tenant!r}")
            seqs.append(seq)
        if unique and len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgument("a sequence appears twice in one batch")
        return seqs

    # ---- figures -------------------------------------------------------------------------------

    def node_stats(self, node_id: str) -> NodeStats:
        node = self._node(node_id)
        pool = node.pool
        bs = pool.block_size
        tail_waste = sum(len(s.block_ids) * bs - s.num_tokens for s in map(self._seqs.get, node.seq_ids))
        # (dropped entries count in both: a dropped block was full, so it adds no waste)
        return NodeStats(
            node_id=node_id, num_blocks=pool.num_blocks, block_size=bs, bytes_per_block=pool.bytes_per_block,
            num_free=pool.num_free, num_cached=pool.num_cached, num_used=pool.num_used,
            lower_tier=self._tiers.counts(pool.slot), num_sequences=len(node.seq_ids),
            tokens_stored=pool.num_used * bs - tail_waste,
            token_capacity=pool.num_used * bs, counters=replace(node.counters),
        )

    def tenant_stats(self, node_id: str) -> list[TenantStats]:
        """Per tenant configured or active on the node."""
        node = self._node(node_id)
        bs, ledger = node.pool.block_size, node.ledger
        lower = self._tiers.charged(node.pool.slot)
        caps = self._lower_caps(node)
        per: dict[str, list[int]] = {t: [0, 0, 0] for t in self._tenants}
        for t in list(ledger.charged) + list(node.tenant_counters) + list(lower):
            per.setdefault(t, [0, 0, 0])
        for seq in map(self._seqs.get, node.seq_ids):
            acc = per.setdefault(seq.tenant, [0, 0, 0])
            acc[0] += 1
            acc[1] += seq.num_tokens - seq.num_dropped * bs
            acc[2] += len(seq.held) * bs
        return [
            TenantStats(
                tenant=t, node_id=node_id, blocks_charged=ledger.charged.get(t, 0),
                blocks_allowed=ledger.allowed.get(t), blocks_reserved=ledger.reserved.get(t, 0),
                lower_tier_blocks=lower.get(t, 0), lower_tier_allowed=caps.get(t),
                num_sequences=n_seqs, tokens_stored=tokens, token_capacity=capacity,
                counters=replace(node.tenant_counters.get(t) or Counters()),
            )
            for t, (n_seqs, tokens, capacity) in per.items()
        ]

    def top_holders(self, node_id: str, limit: int) -> list[Holder]:
        """The ``limit`` live sequences of the node holding the most blocks (ties: by id)."""
        node = self._node(node_id)
        bs, now = node.pool.block_size, time.monotonic()
        seqs = heapq.nsmallest(limit, map(self._seqs.get, node.seq_ids), key=lambda s: (-len(s.block_ids), s.seq_id))
        return [Holder(seq_id=s.seq_id, tenant=s.tenant, num_blocks=len(s.block_ids), num_tokens=s.num_tokens,
                       tail_waste_tokens=len(s.block_ids) * bs - s.num_tokens, age_s=now - s.since,
                       age_at_least=s.recovered) for s in seqs]

    def mark_recovered(self) -> None:
        """Every live sequence predates this process (recovery): their ages are lower bounds."""
        for s in self._seqs.values():
            s.recovered = True

    def allocator_stats(self, node_id: str) -> AllocatorStats:
        node = self._node(node_id)
        p, c = node.pool, node.counters
        return AllocatorStats(p.num_blocks, p.num_free, p.num_cached, p.num_used, c.prefix_queries, c.prefix_hits)

    # ---- snapshots and checks ------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The whole state (not the counters), in a form ``from_dict`` restores exactly."""
        return {
            "tenants": [tenant_to_record(t) for t in self._tenants.values()],
            "nodes": {n: self._node_to_dict(node) for n, node in self._nodes.items()},
            "sequences": [
                [s.seq_id, s.node_id, s.tenant, list(s.block_ids), s.num_tokens, s.num_committed]
                for s in self._seqs.values()
            ],
        }

    def _node_to_dict(self, node: NodeState) -> dict:
        d = {"pool": pool_to_dict(node.pool), "ledger": node.ledger.to_dict()}
        tiers = self._tiers.to_dict(node.pool.slot)
        if tiers is not None:  # absent: nothing below the pool (and snapshots before issue 15)
            d["lower_tiers"] = tiers
        return d

    @classmethod
    def from_dict(cls, d: dict) -> PageTable:
        table = cls()
        table._tenants = {t["name"]: tenant_from_record(t) for t in d["tenants"]}
        for slot, (node_id, nd) in enumerate(d["nodes"].items()):
            pool = pool_from_dict(nd["pool"], table._index, slot)
            if "lower_tiers" in nd:
                table._tiers.restore(slot, nd["lower_tiers"])
            ledger = QuotaLedger(pool.bytes_per_block)
            ledger.restore(nd["ledger"], table._tenants.values())
            table._nodes[node_id] = NodeState(pool, ledger)
        for seq_id, node_id, tenant, block_ids, num_tokens, num_committed in d["sequences"]:
            table._seqs[seq_id] = SeqState(seq_id, node_id, tenant, list(block_ids), num_tokens, num_committed)
            table._nodes[node_id].seq_ids[seq_id] = None
        return table

    def check(self) -> None:
        """Assert DESIGN.md invariants 1-3 on every node."""
        indexed = 0
        for node_id, node in self._nodes.items():
            pool = node.pool
            indexed += pool.check()
            refs = [0] * pool.num_blocks
            for seq_id in node.seq_ids:
                seq = self._seqs[seq_id]
                assert seq.node_id == node_id
                held = seq.held
                assert len(set(held)) == len(held), f"{seq_id} holds a block twice"
                assert len(seq.block_ids) == -(-seq.num_tokens // pool.block_size), f"{seq_id} table size"
                assert seq.block_ids[:seq.num_dropped] == [DROPPED] * seq.num_dropped, f"{seq_id}: drops not a prefix"
                assert seq.num_dropped * pool.block_size <= seq.num_tokens, f"{seq_id}: dropped a block not full"
                for b in held:
                    refs[b] += 1
            assert refs == list(pool.ref), f"node {node_id}: reference counts differ from the block tables"
            node.ledger.check(pool.charged())
        assert sum(len(n.seq_ids) for n in self._nodes.values()) == len(self._seqs)
        self._index.check()
        self._tiers.check({n.pool.slot for n in self._nodes.values()})
        assert indexed == self._index.num_pairs, (
            f"the prefix index holds {self._index.num_pairs} (hash, node) pairs, the pools {indexed}")
        slots = sorted(n.pool.slot for n in self._nodes.values())
        assert len(set(slots)) == len(slots), "two nodes share a slot of the prefix index"
