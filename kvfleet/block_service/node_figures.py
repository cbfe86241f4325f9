"""One node's figures, read from its pool, its books and its live sequences: pool states and
fragmentation (``NodeStats``), per tenant (``TenantStats``), the sequences holding the most blocks
(``Holder``). Pure reads: the page table hands each function what it needs."""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from kvfleet.block_service.cache_figures import cached_by_tenant
from kvfleet.block_service.node_pool import NodePool
from kvfleet.block_service.sequence import SeqState
from kvfleet.block_service.stats import Counters, Holder, NodeStats, TenantStats
from kvfleet.core.ids import is_fetch
from kvfleet.core.tenants import WARMUP_TENANT


def node_stats(node_id: str, node: NodePool, seqs: Iterable[SeqState], lower_tier: dict[str, int]) -> NodeStats:
    pool = node.pool
    bs = pool.block_size
    seqs = list(seqs)
    tail_waste = sum(len(s.block_ids) * bs - s.num_tokens for s in seqs)
    fetches = [s for s in seqs if is_fetch(s.seq_id)]
    # (dropped entries count in both: a dropped block was full, so it adds no waste)
    return NodeStats(
        node_id=node_id, num_blocks=pool.num_blocks, block_size=bs, bytes_per_block=pool.bytes_per_block,
        num_free=pool.num_free, num_cached=pool.num_cached, num_used=pool.num_used,
        lower_tier=lower_tier, num_sequences=len(node.seq_ids),
        tokens_stored=pool.num_used * bs - tail_waste,
        token_capacity=pool.num_used * bs, counters=replace(node.counters, evictions=_by_reason(pool.evictions())),
        transfers_in_flight=len(fetches), transfer_blocks_in_flight=sum(len(s.block_ids) for s in fetches),
    )


def tenant_stats(node_id: str, node: NodePool, seqs: Iterable[SeqState], tenants: Iterable[str],
                 lower: dict[str, int], caps: dict[str, int]) -> list[TenantStats]:
    """Per tenant configured (``tenants``) or active on the node; ``lower`` the blocks each has in
    the node's lower tiers, ``caps`` their caps there. The nodes' own warm-up shows only while it
    holds blocks (the pool's figures must add up), never for its counters: it is not a tenant."""
    bs, ledger, evictions = node.pool.block_size, node.ledger, node.pool.evictions()
    cached = cached_by_tenant(node.pool) if node.pool.num_cached else {}
    per: dict[str, list[int]] = {t: [0, 0, 0] for t in tenants}
    for t in list(ledger.charged) + list(node.tenant_counters) + list(lower) + list(evictions) + list(cached):
        per.setdefault(t, [0, 0, 0])
    for seq in seqs:
        acc = per.setdefault(seq.tenant, [0, 0, 0])
        acc[0] += 1
        acc[1] += seq.num_tokens - seq.num_dropped * bs
        acc[2] += len(seq.held) * bs
    if per.get(WARMUP_TENANT) == [0, 0, 0] and not (ledger.charged.get(WARMUP_TENANT) or cached.get(WARMUP_TENANT)
                                                  or lower.get(WARMUP_TENANT)):
        del per[WARMUP_TENANT]
    return [
        TenantStats(
            tenant=t, node_id=node_id, blocks_charged=ledger.charged.get(t, 0),
            blocks_allowed=ledger.allowed.get(t), blocks_reserved=ledger.reserved.get(t, 0),
            lower_tier_blocks=lower.get(t, 0), lower_tier_allowed=caps.get(t), cached_blocks=cached.get(t, 0),
            num_sequences=n_seqs, tokens_stored=tokens, token_capacity=capacity,
            counters=replace(node.tenant_counters.get(t) or Counters(), evictions=evictions.get(t, {})),
        )
        for t, (n_seqs, tokens, capacity) in per.items()
    ]


def _by_reason(evictions: dict[str, dict[str, int]]) -> dict[str, int]:
    """The pool's evictions per reason, all tenants together."""
    out: dict[str, int] = {}
    for by in evictions.values():
        for reason, n in by.items():
            out[reason] = out.get(reason, 0) + n
    return out


def top_holders(block_size: int, seqs: Sequence[SeqState], limit: int) -> list[Holder]:
    """The ``limit`` sequences holding the most blocks (ties: by id)."""
    now = time.monotonic()
    top = heapq.nsmallest(limit, seqs, key=lambda s: (-len(s.block_ids), s.seq_id))
    return [Holder(seq_id=s.seq_id, tenant=s.tenant, num_blocks=len(s.block_ids), num_tokens=s.num_tokens,
                   tail_waste_tokens=len(s.block_ids) * block_size - s.num_tokens, age_s=now - s.since,
                   age_at_least=s.recovered) for s in top]
