"""block_service's Prometheus metrics: the page table's own figures, sampled at scrape time.

    sample(store) on the event loop ─▶ BlockServiceSample (copied stats) ─▶ families() in the HTTP thread

The nodes export vLLM's names for their own pools (``kvfleet:kv_cache_usage_perc``, the prefix
cache); block_service exports what vLLM has not, under ``pool_*`` names so that the two are never
summed: every pool by state and fragmentation, the committed blocks each node keeps below its pool
by tier (``lower_tier_blocks``: host, disk), per-tenant blocks charged against the quota and against
the lower-tier cap, refusals by tenant and reason (pool, quota, lower_tier), evictions by tenant and
the eviction policy's reason (``block_evictions_total``: lru, value, over_share, within_share), the
cached blocks each tenant holds against its share of them (``cached_blocks``, ``cache_share_blocks``),
the write-ahead log and the snapshot's age. Operations by kind
and the log's write latency are observed as they happen (``BlockServiceMetrics``): an RPC interceptor
counts calls, the durable store reports each group commit's write + fsync time, a replica counts
the leads it ended by reason (``block_service_step_downs_total``).
Labels are node ids and tenant names, both bounded by configuration.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from kvfleet.block_service.stats import NodeStats, TenantStats
from kvfleet.block_service.tenants import cache_shares
from kvfleet.core.metric_families import PREFIX, counter, gauge
from kvfleet.core.metrics_server import FSYNC_BUCKETS


@dataclass(slots=True, frozen=True)
class BlockServiceSample:
    nodes: list[NodeStats]
    tenants: list[TenantStats]
    log_records: int                # records durable since the first start
    log_bytes: int                  # size of the current log (since the last snapshot)
    snapshot_age_s: float | None    # None: durability off, no snapshots
    pins: tuple = ()                # ``pins.TenantPins`` per tenant and node holding pins
    pins_refused: tuple = ()        # ((tenant, reason), count): pins refused since start
    shares: dict[str, dict[str, int]] = field(default_factory=dict)  # node -> tenant -> its cache share, blocks


def sample(store, now: float | None = None) -> BlockServiceSample:
    """The figures of a ``DurablePageTable``, copied; call on the event loop that owns it."""
    table = store.table
    node_ids = table.node_ids()
    now = time.monotonic() if now is None else now
    nodes, tenants = [table.node_stats(n) for n in node_ids], table.tenants()
    return BlockServiceSample(
        nodes=nodes,
        tenants=[t for n in node_ids for t in table.tenant_stats(n)],
        log_records=store.durable_lsn, log_bytes=store.log_bytes,
        snapshot_age_s=now - store.last_snapshot if store.state_dir else None,
        shares={n.node_id: cache_shares(tenants, n.bytes_per_block) for n in nodes},
        pins=tuple(table.pins.summary()), pins_refused=tuple(sorted(store.pins_refused.items())),
    )


def families(s: BlockServiceSample) -> Iterator[Metric]:
    node = ("node",)
    yield gauge("pool_usage_perc", "Share of the node's KV blocks in use by live sequences (0-1)", node,
                [((n.node_id,), n.num_used / n.num_blocks if n.num_blocks else 0.0) for n in s.nodes])
    yield gauge("pool_blocks", "KV blocks of the node's pool by state (used + cached + free = total)",
                ("node", "state"),
                [((n.node_id, state), v) for n in s.nodes
                 for state, v in (("used", n.num_used), ("cached", n.num_cached), ("free", n.num_free))])
    yield gauge("pool_fragmentation_perc", "Share of the used blocks' token slots holding no token (0-1)",
                node, [((n.node_id,), n.fragmentation) for n in s.nodes])
    yield gauge("num_sequences", "Live sequences holding blocks on the node", node,
                [((n.node_id,), n.num_sequences) for n in s.nodes])
    yield gauge("lower_tier_blocks", "Committed KV blocks the node keeps below its pool, by tier (host, disk)",
                ("node", "tier"), [((n.node_id, tier), v) for n in s.nodes for tier, v in n.lower_tier.items()])
    yield counter("reconciled_releases", "Sequences released because their node no longer held them", node,
                  [((n.node_id,), n.counters.reconciled_releases) for n in s.nodes])
    tenant = ("tenant", "node")
    yield gauge("tenant_blocks_charged", "Blocks charged to the tenant on the node", tenant,
                [((t.tenant, t.node_id), t.blocks_charged) for t in s.tenants])
    yield gauge("tenant_blocks_quota", "Blocks the tenant may hold on the node (absent: unlimited)", tenant,
                [((t.tenant, t.node_id), t.blocks_allowed) for t in s.tenants if t.blocks_allowed is not None])
    yield gauge("tenant_lower_tier_blocks", "Blocks charged to the tenant's lower-tier cap on the node", tenant,
                [((t.tenant, t.node_id), t.lower_tier_blocks) for t in s.tenants])
    yield gauge("tenant_lower_tier_quota", "Blocks the tenant may keep in the node's lower tiers (absent: unlimited)",
                tenant, [((t.tenant, t.node_id), t.lower_tier_allowed) for t in s.tenants
                         if t.lower_tier_allowed is not None])
    yield gauge("tenant_blocks_reserved", "Blocks reserved for the tenant on the node", tenant,
                [((t.tenant, t.node_id), t.blocks_reserved) for t in s.tenants])
    yield gauge("tenant_sequences", "The tenant's live sequences on the node", tenant,
                [((t.tenant, t.node_id), t.num_sequences) for t in s.tenants])
    yield counter("block_refusals",
                  "Block requests refused, by tenant, node and reason (pool, quota, or lower_tier: a demotion "
                  "past the tenant's lower-tier cap)", ("tenant", "node", "reason"),
                  [((t.tenant, t.node_id, reason), v) for t in s.tenants
                   for reason, v in (("pool", t.counters.refusals_pool), ("quota", t.counters.refusals_quota),
                                     ("lower_tier", t.counters.refusals_lower_tier))])
    yield counter("block_evictions",
                  "Cached blocks evicted, by the tenant last charged for them, node and the eviction policy's "
                  "reason (lru, value, over_share: its tenant held more cached blocks than its share, within_share)",
                  ("tenant", "node", "reason"),
                  [((t.tenant, t.node_id, reason), v) for t in s.tenants for reason, v in sorted(t.counters.evictions.items())])
    yield gauge("cached_blocks", "Cached (evictable) blocks on the node, by the tenant last charged for them "
                "(\"\": not known)", tenant, [((t.tenant, t.node_id), t.cached_blocks) for t in s.tenants])
    yield gauge("cache_share_blocks", "The tenant's share of the node's cached blocks under the fair eviction "
                "policies (cache_share_mib, else reserved_mib; absent: none). Shares are weights: they may sum past "
                "the pool", tenant, [((t, node), n) for node, shares in sorted(s.shares.items())
                                     for t, n in sorted(shares.items())])
    yield gauge("pinned_blocks", "Blocks the tenant has pinned on the node (cached or not yet: each counts against "
                "its pinned_mib budget)", ("tenant", "node"), [((p.tenant, p.node_id), p.pinned) for p in s.pins])
    yield counter("pins_refused", "Pins refused, by tenant and reason (budget: past its pinned_mib; no_budget: "
                  "pinned_mib 0)", ("tenant", "reason"), [((t, why), n) for (t, why), n in s.pins_refused])
    yield counter("wal_records", "Write-ahead log records durable since the first start", (), [((), s.log_records)])
    yield gauge("wal_bytes", "Size of the write-ahead log since the last snapshot", (), [((), s.log_bytes)])
    if s.snapshot_age_s is not None:
        yield gauge("snapshot_age_seconds", "Seconds since the last full snapshot", (), [((), s.snapshot_age_s)])


class BlockServiceMetrics:
    """block_service's registry: the sampled families (registered by the caller, who owns the
    loop) plus what is observed as it happens."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.operations = Counter(PREFIX + "block_service_operations", "BlockManager calls by operation",
                                  ["operation"], registry=self.registry)
        self.interceptors: list = []  # the gRPC server's (kvfleet.core.rpc_metrics.CallCounter over ``operations``)
        self.step_downs = Counter(PREFIX + "block_service_step_downs",
                                  "Leads this replica ended, by reason (nodes_unreachable: every live node said it "
                                  "could not reach it, so it resigned; lease_lost: its lease lapsed or was taken)",
                                  ["reason"], registry=self.registry)
        self.wal_fsync = Histogram(PREFIX + "wal_fsync_seconds",
                                   "One group commit of the write-ahead log: write + fsync",
                                   buckets=FSYNC_BUCKETS, registry=self.registry)
