"""What ``kvfleet blocks`` shows: per node, its pool by tier (device, and the committed blocks it keeps
below it in host memory and on disk), the sequences holding the most blocks, the internal waste of
partly filled last blocks, and per tenant the blocks charged against the quota and the lower-tier
blocks charged against the tenant's lower-tier cap.

The second step of the field guide's OOM flow: the ``block_pool exhausted (alloc=N/N)`` line says a
pool ran dry and which tenants hold it; this says which requests, how long they have held it, and
whether the pool is full of live blocks, of cache (evictable, so not the cause), or of waste.
Pure: built from the figures the Stats call returns (``client.BlockManagerClient.blocks``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from kvfleet.block_service.pins import TenantPins
from kvfleet.block_service.stats import Holder, NodeStats, TenantStats, TierBlocks


@dataclass(slots=True, frozen=True)
class NodeBlocks:
    stats: NodeStats
    tiers: list[TierBlocks] = field(default_factory=list)
    holders: list[Holder] = field(default_factory=list)
    role: str = ""  # mixed, prefill or decode, from membership ("": not known)
    group: str = ""  # kvfleet.core.groups: stable, canary, ..., from membership ("": not known)

    @property
    def waste_tokens(self) -> int:
        """Unused slots of the live sequences' last blocks (token capacity less tokens stored)."""
        return self.stats.token_capacity - self.stats.tokens_stored


@dataclass(slots=True, frozen=True)
class BlocksReport:
    nodes: list[NodeBlocks]
    tenants: list[TenantStats]
    log_records: int = 0
    pins: list[TenantPins] = field(default_factory=list)  # per tenant and node holding pins


def to_json(report: BlocksReport) -> dict:
    """The report as plain data (``--json``): one object per node, one per tenant and node."""
    nodes = []
    for n in report.nodes:
        s = n.stats
        nodes.append({
            "node_id": s.node_id, "role": n.role or None, "group": n.group or None,
            "num_blocks": s.num_blocks, "block_size": s.block_size,
            "bytes_per_block": s.bytes_per_block, "used": s.num_used, "cached": s.num_cached, "free": s.num_free,
            "num_sequences": s.num_sequences, "tiers": [asdict(t) for t in n.tiers],
            "waste_tokens": n.waste_tokens, "waste_frac": round(s.fragmentation, 4),
            "refusals_pool": s.counters.refusals_pool, "refusals_quota": s.counters.refusals_quota,
            "lower_tier": dict(s.lower_tier), "refusals_lower_tier": s.counters.refusals_lower_tier,
            "transfers_in_flight": s.transfers_in_flight, "transfer_blocks_in_flight": s.transfer_blocks_in_flight,
            "top_holders": [asdict(h) for h in n.holders],
        })
    tenants = [{
        "tenant": t.tenant, "node_id": t.node_id, "charged": t.blocks_charged, "quota": t.blocks_allowed,
        "reserved": t.blocks_reserved, "num_sequences": t.num_sequences,
        "refusals_pool": t.counters.refusals_pool, "refusals_quota": t.counters.refusals_quota,
        "lower_tier": t.lower_tier_blocks, "lower_tier_quota": t.lower_tier_allowed,
        "refusals_lower_tier": t.counters.refusals_lower_tier, "evictions": dict(t.counters.evictions),
    } for t in report.tenants]
    pins = [asdict(p) for p in report.pins]
    return {"nodes": nodes, "tenants": tenants, "log_records": report.log_records, "pins": pins}


def _limit(blocks: int | None) -> str:
    return "unlimited" if blocks is None else str(blocks)


def _age(h: Holder) -> str:
    return (">" if h.age_at_least else "") + f"{h.age_s:.0f}s"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def render(report: BlocksReport) -> str:
    """The report for a person: a block per node, then the tenants' charges against quota."""
    if not report.nodes:
        return "no nodes registered"
    lines: list[str] = []
    for n in report.nodes:
        s = n.stats
        label = ", ".join(x for x in (n.role, f"group {n.group}" if n.group else "") if x)
        lines.append(f"node {s.node_id}{f' ({label})' if label else ''}: {s.num_blocks} blocks of {s.block_size} tokens, "
                     f"{s.num_sequences} sequences, refusals pool={s.counters.refusals_pool} "
                     f"quota={s.counters.refusals_quota}")
        lines += ["  " + line for line in _table(
            ["tier", "used", "cached", "free"],
            [[t.tier, str(t.num_used), str(t.num_cached), str(t.num_free)] for t in n.tiers])]
        lines.append(f"  waste: {n.waste_tokens} token slots unused in partly filled last blocks "
                     f"({s.fragmentation:.1%} of the used blocks' capacity)")
        if s.transfers_in_flight:
            lines.append(f"  transfers in flight: {s.transfers_in_flight} fetches from peers holding "
                         f"{s.transfer_blocks_in_flight} blocks")
        if n.holders:
            lines.append("  top holders:")
            lines += ["    " + line for line in _table(
                ["sequence", "tenant", "blocks", "tokens", "waste", "age"],
                [[h.seq_id, h.tenant, str(h.num_blocks), str(h.num_tokens), str(h.tail_waste_tokens), _age(h)]
                 for h in n.holders])]
    if report.tenants:
        lines.append("tenants (blocks):")
        lines += ["  " + line for line in _table(
            ["tenant", "node", "charged", "quota", "reserved", "sequences", "refused pool", "refused quota",
             "lower tier", "lower cap", "refused lower", "evicted"],
            [[t.tenant, t.node_id, str(t.blocks_charged), _limit(t.blocks_allowed), str(t.blocks_reserved),
              str(t.num_sequences), str(t.counters.refusals_pool), str(t.counters.refusals_quota),
              str(t.lower_tier_blocks), _limit(t.lower_tier_allowed), str(t.counters.refusals_lower_tier),
              str(sum(t.counters.evictions.values()))]
             for t in report.tenants])]
    if report.pins:
        lines.append("pins (blocks; a lowered budget keeps older pins until they expire):")
        lines += ["  " + line for line in _table(
            ["tenant", "node", "pinned", "budget", "on node", "earliest expiry"],
            [[p.tenant, p.node_id, str(p.pinned), str(p.allowed), str(p.cached),
              time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(p.earliest))] for p in report.pins])]
    if any(h.age_at_least for n in report.nodes for h in n.holders):
        lines.append("(>: allocated before block_service's last start; the age counts from that start)")
    return "\n".join(lines)
