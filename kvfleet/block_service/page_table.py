"""The fleet's page table: every node's block pool, every live sequence, every tenant's quota.

Three layers, one job each: ``BlockPool`` owns one node's block metadata (free list, cached blocks
in the order of the table's eviction policy, reference counts, its part of the prefix index);
``QuotaLedger`` owns one node's charges per tenant (the two together: ``NodePool``, and all of them:
``Fleet``, with the one ``PrefixIndex`` — block hash → the nodes holding it — the pools share, so
that ``match_prefix`` costs the same whatever the number of nodes holding the prefix);
``PageTable`` gives the per-sequence API over all nodes and keeps the block tables. Every call validates its whole
batch before changing anything, so an exception leaves the state untouched; a full pool or quota is
an answer (``Refusal``). The page table is deterministic, which the write-ahead log relies on:
replaying the same calls on the same state gives the same block ids — its eviction policy
(``eviction``, chosen by name) included.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvfleet.block_service import node_figures
from kvfleet.block_service.block_pool import validate_shape
from kvfleet.block_service.eviction import DEFAULT_POLICY
from kvfleet.block_service.eviction.lru import BlockLru
from kvfleet.block_service.fleet import Fleet
from kvfleet.block_service.lower_tiers import TierOutcome
from kvfleet.block_service.node_pool import NodePool
from kvfleet.block_service.node_sync import LiveSequence, SyncResult, plan_sync
from kvfleet.block_service.pins import FleetPins
from kvfleet.block_service.sequence import SeqState
from kvfleet.block_service.stats import Holder, NodeStats, TenantStats
from kvfleet.block_service.validation import validate_hashes, validate_tokens
from kvfleet.core.allocator import DROPPED, AllocateRequest, Allocation, AllocatorStats, Refusal, TierChange
from kvfleet.core.block_hash import HASH_BYTES
from kvfleet.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from kvfleet.core.ids import check_id
from kvfleet.core.tenants import Tenant

log = logging.getLogger(__name__)


class PageTable:
    def __init__(self, eviction: str = DEFAULT_POLICY) -> None:
        """``eviction``: the name of the eviction policy of every pool (``kvfleet.block_service.eviction``);
        an unknown name raises ``InvalidArgument``."""
        self._fleet = Fleet(eviction)
        self._nodes = self._fleet.nodes  # (the same dict: the fleet never replaces it)
        self._seqs: dict[str, SeqState] = {}

    @property
    def eviction(self) -> str:
        return self._fleet.eviction

    # ---- nodes and tenants ---------------------------------------------------------------------

    def register_node(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int) -> bool:
        """Add a node's pool; True if new. Registering the same shape again is a no-op."""
        return self._fleet.add(node_id, num_blocks, block_size, bytes_per_block)

    def deregister_node(self, node_id: str) -> list[str]:
        """Drop a node and release all its sequences; returns their ids."""
        released = list(self._node(node_id).seq_ids)
        self._release(released)
        self._fleet.remove(node_id)
        return released

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
                self._unreference(node, old.held, len(old.block_ids))
            num_committed = sum(1 for b in s.block_ids if b != DROPPED and node.pool.hash[b] is not None)
            self._seqs[s.seq_id] = SeqState(s.seq_id, node_id, s.tenant, list(s.block_ids), s.num_tokens,
                                            num_committed)
            node.seq_ids[s.seq_id] = None
        if result.released:
            node.counters.reconciled_releases += len(result.released)
            log.info("sync of node %s: released %d sequences the node no longer holds", node_id,
                     len(result.released))
        return result

    def _tenant_seqs(self, node: NodePool) -> dict[str, int]:
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
        """Add or update tenants (``replace_all``: the given list is the whole set)."""
        self._fleet.configure_tenants(configs, replace_all)

    def node_ids(self) -> list[str]:
        return list(self._nodes)

    def tenants(self) -> list[Tenant]:
        return list(self._fleet.tenants.values())

    def block_size(self, node_id: str) -> int:
        return self._node(node_id).pool.block_size

    def node_of(self, seq_id: str) -> str | None:
        """The node live sequence ``seq_id`` is on; None when none is live under that id."""
        seq = self._seqs.get(seq_id)
        return None if seq is None else seq.node_id

    def sequence(self, seq_id: str) -> SeqState:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown sequence {seq_id!r}")
        return replace(seq, block_ids=list(seq.block_ids))

    def num_available(self, node_id: str, tenant: str | None = None) -> int:
        """Blocks an allocation could take now (for ``tenant``: less what others have reserved, and
        none when their reservations exceed what is available)."""
        node = self._node(node_id)
        avail = node.pool.num_available()
        return max(avail - node.ledger.reserved_for_others(tenant), 0) if tenant else avail

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
            self._unreference(node, seq.held, len(seq.block_ids))

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
            self._unreference(self._nodes[seq.node_id], gone, n)

    @staticmethod
    def _unreference(node: NodePool, block_ids: list[int], depth: int) -> None:
        """Give back ``block_ids``, the entries of a table up to position ``depth - 1``, deepest
        first, and uncharge those no table holds any more."""
        uncharged: dict[str, int] = {}
        node.pool.release(block_ids[::-1], uncharged, depth)
        for t, n in uncharged.items():
            node.ledger.uncharge(t, n)

    def match_prefix(self, block_hashes: Sequence[bytes], node_ids: Sequence[str] | None = None) -> dict[str, int]:
        """Per node, how many leading blocks of the prompt are committed there. Changes nothing."""
        return self.match_tiers(block_hashes, node_ids)[0]

    def match_tiers(self, block_hashes: Sequence[bytes],
                    node_ids: Sequence[str] | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """``(hot, lower)`` blocks of the prompt per node (``Fleet.match_tiers``). Changes nothing."""
        return self._fleet.match_tiers(block_hashes, node_ids)

    @property
    def pins(self) -> FleetPins:
        """The nodes' pins (``kvfleet.block_service.pins``): ``pin``, ``expire`` (the log's calls), ``due``, ``summary``."""
        return FleetPins(self._fleet)

    # ---- lower tiers ---------------------------------------------------------------------------

    def record_tiers(self, node_id: str, changes: Sequence[TierChange]) -> TierOutcome:
        """The node moved these committed blocks between its lower tiers (``Fleet.record_tiers``)."""
        return self._fleet.record_tiers(node_id, changes)

    def replace_tiers(self, node_id: str, held: Sequence[TierChange]) -> bool:
        """The node's whole lower-tier index is ``held`` (``Fleet.replace_tiers``)."""
        return self._fleet.replace_tiers(node_id, held)

    def lower_tiers(self, node_id: str) -> list[TierChange]:
        """What the node holds below its pool, as this table knows it."""
        return self._fleet.lower_tiers(node_id)

    # ---- helpers -------------------------------------------------------------------------------

    def _node(self, node_id: str) -> NodePool:
        return self._fleet.node(node_id)

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
        return node_figures.node_stats(node_id, node, self._seqs_of(node), self._fleet.tiers.counts(node.pool.slot))

    def tenant_stats(self, node_id: str) -> list[TenantStats]:
        """Per tenant configured or active on the node."""
        node = self._node(node_id)
        fleet = self._fleet
        return node_figures.tenant_stats(node_id, node, self._seqs_of(node), fleet.tenants,
                                         fleet.tiers.charged(node.pool.slot), fleet.lower_caps(node))

    def top_holders(self, node_id: str, limit: int) -> list[Holder]:
        """The ``limit`` live sequences of the node holding the most blocks (ties: by id)."""
        node = self._node(node_id)
        return node_figures.top_holders(node.pool.block_size, self._seqs_of(node), limit)

    def _seqs_of(self, node: NodePool) -> list[SeqState]:
        return list(map(self._seqs.get, node.seq_ids))

    def next_victims(self, node_id: str, n: int) -> list[int]:
        """The cached blocks of the node that the next allocations past its free list would evict,
        in order (the eviction policy's answer; changes nothing)."""
        return self._node(node_id).pool.next_victims(n)

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
        return {"eviction": self.eviction, **self._fleet.to_dict(),
                "sequences": [s.to_record() for s in self._seqs.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> PageTable:
        """The table ``to_dict`` described, under the eviction policy it names (LRU when it names
        none: states written before policies could be chosen)."""
        table = cls(d.get("eviction", BlockLru.name))
        table._fleet.restore(d)
        for r in d["sequences"]:
            seq = table._seqs[r[0]] = SeqState.from_record(r)
            table._nodes[seq.node_id].seq_ids[seq.seq_id] = None
        return table

    def check(self) -> None:
        """Assert docs/design.md invariants 1-3 on every node."""
        indexed = sum(node.check(node_id, self._seqs_of(node)) for node_id, node in self._nodes.items())
        assert sum(len(n.seq_ids) for n in self._nodes.values()) == len(self._seqs)
        self._fleet.check(indexed)
