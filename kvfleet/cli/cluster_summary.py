"""The local cluster's closing table: blocks per node with the prefix hit rate, then each tenant's
usage per node, as block_service counts them (``LocalCluster.summary``)."""

from __future__ import annotations

from kvfleet.core.tenants import WARMUP_TENANT


def blocks_table(nodes, tenants) -> str:
    lines = ["node       blocks   used  cached   free  prefix hits"]
    for n in sorted(nodes, key=lambda n: n.node_id):
        c = n.counters
        share = f" ({c.prefix_hits / c.prefix_queries:.0%})" if c.prefix_queries else ""
        rate = f"{c.prefix_hits}/{c.prefix_queries}{share}"
        lines.append(f"{n.node_id:<10} {n.num_blocks:>6} {n.num_used:>6} {n.num_cached:>7} {n.num_free:>6}  {rate}")
    lines.append("tenant     node       charged  allowed  sequences")
    for t in sorted(tenants, key=lambda t: (t.tenant, t.node_id)):
        if t.tenant == WARMUP_TENANT:  # the nodes' own warm-up, not a user's tenant
            continue
        allowed = "-" if t.blocks_allowed is None else str(t.blocks_allowed)
        lines.append(f"{t.tenant:<10} {t.node_id:<10} {t.blocks_charged:>7} {allowed:>8} {t.num_sequences:>10}")
    return "\n".join(lines)
