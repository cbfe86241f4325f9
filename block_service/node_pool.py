"""What the page table keeps per node: its pool, its quota ledger, its live sequences, its counters,
and the one decision that needs all of them: may a tenant be charged ``n`` more blocks here now?

A full pool or quota is an answer (``Refusal``), counted per node and tenant; a full pool is also
logged, at most once per ``WARN_INTERVAL_S`` per node, with the tenants holding the most blocks, so
that an operator sees who filled it (``block_pool exhausted (alloc=N/N) node=… tenant=…``); the line
says how many refusals went unlogged since the previous one (``suppressed=N``), so a burst is
counted, not hidden. ``kvfleet blocks`` then names the sequences.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from block_service.block_pool import BlockPool
from block_service.stats import Counters
from block_service.tenants import QuotaLedger
from kvfleet.allocator import Refusal

log = logging.getLogger(__name__)

WARN_INTERVAL_S = 1.0           # pool-exhausted warnings per node, at most one per interval
TOP_HOLDERS = 3


@dataclass(slots=True)
class NodeState:
    pool: BlockPool
    ledger: QuotaLedger
    seq_ids: dict[str, None] = field(default_factory=dict)  # insertion order: deterministic
    counters: Counters = field(default_factory=Counters)
    tenant_counters: dict[str, Counters] = field(default_factory=dict)
    last_warning: float = float("-inf")
    suppressed_warnings: int = 0  # pool refusals not logged since the last line (the interval)

    def tenant_counter(self, tenant: str) -> Counters:
        c = self.tenant_counters.get(tenant)
        if c is None:
            c = self.tenant_counters[tenant] = Counters()
        return c

    def refusal(self, node_id: str, tenant: str, n: int,
                seqs_per_tenant: Callable[[NodeState], dict[str, int]]) -> Refusal | None:
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
