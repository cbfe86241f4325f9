"""What the page table keeps per node: its pool, its quota ledger, its live sequences, its counters,
and the one decision that needs all of them: may a tenant be charged ``n`` more blocks here now?
(Not ``kvfleet.core.membership.NodeState``, a node's lifecycle: this is a node's pool and its books.)

A full pool or quota is an answer (``Refusal``), counted per node and tenant; a full pool is also
logged, at most once per ``WARN_INTERVAL_S`` per node, with the tenants holding the most blocks, so
that an operator sees who filled it (``block_pool exhausted (alloc=N/N) node=… tenant=…``); the line
says how many refusals went unlogged since the previous one (``suppressed=N``), so a burst is
counted, not hidden. ``kvfleet blocks`` then names the sequences.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvfleet.block_service import pins as pinning
from kvfleet.block_service.block_pool import BlockPool
from kvfleet.block_service.pool_codec import pool_from_dict, pool_to_dict
from kvfleet.block_service.prefix_index import PrefixIndex
from kvfleet.block_service.sequence import SeqState
from kvfleet.block_service.stats import Counters
from kvfleet.block_service.tenants import QuotaLedger, cache_shares
from kvfleet.core.allocator import DROPPED, Refusal
from kvfleet.core.tenants import Tenant

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 1.0           # pool-exhausted warnings per node, at most one per interval
TOP_HOLDERS = 3


@dataclass(slots=True)
class NodePool:
    pool: BlockPool
    ledger: QuotaLedger
    seq_ids: dict[str, None] = field(default_factory=dict)  # insertion order: deterministic
    counters: Counters = field(default_factory=Counters)
    tenant_counters: dict[str, Counters] = field(default_factory=dict)
    last_warning: float = float("-inf")
    suppressed_warnings: int = 0  # pool refusals not logged since the last line (the interval)
    pins: pinning.NodePins | None = None  # its pins by hash (``kvfleet.block_service.pins``); None: never pinned

    def configure(self, tenants: Iterable[Tenant]) -> None:
        """The tenants' quotas and reserved shares in this pool's blocks for the ledger, their shares
        of its cached blocks for the eviction policy."""
        tenants = list(tenants)
        self.ledger.configure(tenants)
        self.pool.set_shares(cache_shares(tenants, self.pool.bytes_per_block))

    def to_dict(self) -> dict:
        """The pool and its ledger (not the counters), for a snapshot; ``from_dict`` restores them."""
        d = {"pool": pool_to_dict(self.pool), "ledger": self.ledger.to_dict()}
        if self.pins is not None and self.pins.pins:  # absent: none (and snapshots before pins)
            d["pins"] = self.pins.to_list()
        return d

    @classmethod
    def from_dict(cls, d: dict, index: PrefixIndex, slot: int, tenants: Iterable[Tenant], eviction: str) -> NodePool:
        """The node ``to_dict`` described, its hashes staged in ``index`` (``PrefixIndex.settle``)."""
        pool = pool_from_dict(d["pool"], index, slot, eviction)
        tenants = list(tenants)
        ledger = QuotaLedger(pool.bytes_per_block)
        ledger.restore(d["ledger"], tenants)
        pool.set_shares(cache_shares(tenants, pool.bytes_per_block))
        node = cls(pool, ledger)
        if d.get("pins"):  # held by the pool's policy once the hashes are indexed (``Fleet.restore``)
            node.pins = pinning.NodePins.from_list(d["pins"])
        return node

    def check(self, node_id: str, seqs: Iterable[SeqState]) -> int:
        """Invariants 1-3 on this node, ``seqs`` being its live sequences; returns how many hashes
        its pool indexes (``BlockPool.check``)."""
        pool = self.pool
        indexed = pool.check()
        refs = [0] * pool.num_blocks
        for seq in seqs:
            assert seq.node_id == node_id
            held = seq.held
            assert len(set(held)) == len(held), f"{seq.seq_id} holds a block twice"
            assert len(seq.block_ids) == -(-seq.num_tokens // pool.block_size), f"{seq.seq_id} table size"
            assert seq.block_ids[:seq.num_dropped] == [DROPPED] * seq.num_dropped, f"{seq.seq_id}: drops not a prefix"
            assert seq.num_dropped * pool.block_size <= seq.num_tokens, f"{seq.seq_id}: dropped a block not full"
            for b in held:
                refs[b] += 1
        assert refs == list(pool.ref), f"node {node_id}: reference counts differ from the block tables"
        self.ledger.check(pool.charged())
        pinning.check(self)
        return indexed

    def tenant_counter(self, tenant: str) -> Counters:
        c = self.tenant_counters.get(tenant)
        if c is None:
            c = self.tenant_counters[tenant] = Counters()
        return c

    def refusal(self, node_id: str, tenant: str, n: int,
                seqs_per_tenant: Callable[[NodePool], dict[str, int]]) -> Refusal | None:
        """None if ``tenant`` may be charged ``n`` more blocks here now, else why not.
        ``seqs_per_tenant`` counts the node's live sequences per tenant, for the warning only."""
        ledger, pool = self.ledger, self.pool
        allowed = ledger.quota_shortfall(tenant, n)
        if allowed is not None:
            for c in (self.counters, self.tenant_counter(tenant)):
                c.refusals_quota += 1
            return Refusal("quota", node_id, tenant, n, ledger.charged.get(tenant, 0), allowed)
        if n <= pool.num_available() - ledger.reserved_for_others(tenant):
            return None
        for c in (self.counters, self.tenant_counter(tenant)):
            c.refusals_pool += 1
        now = time.monotonic()
        if now - self.last_warning >= WARN_INTERVAL_S:
            self.last_warning = now
            log.warning(
                "block_pool exhausted (alloc=%d/%d) node=%s tenant=%s asked=%d available=%d "
                "reserved_for_others=%d suppressed=%d top holders: %s",
                pool.num_used, pool.num_blocks, node_id, tenant, n, pool.num_available(),
                ledger.reserved_for_others(tenant), self.suppressed_warnings,
                self._top_holders(seqs_per_tenant(self)),
            )
            self.suppressed_warnings = 0
        else:
            self.suppressed_warnings += 1
        return Refusal("pool", node_id, tenant, n, pool.num_used, pool.num_blocks)

    def _top_holders(self, seqs: dict[str, int]) -> str:
        charged = self.ledger.charged
        ranked = sorted(charged, key=lambda t: -charged[t])[:TOP_HOLDERS]
        return ", ".join(f"tenant={t} sequences={seqs.get(t, 0)} blocks={charged[t]}" for t in ranked) or "none"
