"""A compute node's Prometheus metrics: the engine's own figures, sampled at scrape time.

    sample() on the event loop (the engine thread answers) ─▶ NodeSample ─▶ families() in the HTTP thread

The engine is vLLM's counterpart, so its figures take vLLM's names with the ``kvfleet:`` prefix:
requests running and waiting, the KV cache's usage, prefix-cache queries and hits (in tokens: the
cache works in whole blocks, so both count ``block_size`` tokens per block; per ``tenant``, hits also
per ``tier``), preemptions. Request
level counts (prompt and generation tokens as the client was charged, latencies) are the router's,
where a request's whole life, failovers included, is seen; the node's token counters are named
``node_*`` so that a sum over both never counts a token twice. The pool's figures come from the
node's allocator, which for a remote pool asks block_service (the reading costs the engine thread
one small RPC per scrape). Every family carries the ``node`` label; tenant labels are the tenants
file's names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.metrics_core import Metric

from kvfleet.compute_service.engine.stats import EngineStats
from kvfleet.compute_service.node.fetch_figures import FetchReading
from kvfleet.core.metric_families import counter, gauge, histogram


@dataclass(slots=True, frozen=True)
class NodeSample:
    """The node's own few figures around the engine's stats object, read as it is."""

    node_id: str
    state: str                    # WARMING / READY / DRAINING
    block_size: int
    num_in_flight: int            # request streams open on the node
    engine: EngineStats
    fetch: FetchReading | None = None  # KV fetched from peers (None: the node fetches none)
    role: str = "mixed"           # kvfleet.core.roles
    group: str = "stable"         # kvfleet.core.groups
    block_sync_calls: tuple[tuple[str, int], ...] = ()  # (call, count): block_service calls a step waited on


def families(s: NodeSample) -> Iterator[Metric]:
    node = ("node",)
    key = (s.node_id,)
    e = s.engine
    b = e.blocks
    yield gauge("num_requests_running", "Requests in the engine's running batch", node, [(key, e.num_running)])
    yield gauge("num_requests_waiting", "Requests waiting in the engine for blocks or a batch slot", node,
                [(key, e.num_waiting)])
    yield gauge("max_num_seqs_live", "Live cap on running sequences (below --max-num-seqs while the P99 "
                "batch controller holds it down)", node, [(key, e.max_num_seqs_live)])
    yield gauge("kv_cache_usage_perc", "Share of the node's KV blocks used by live sequences (0-1)", node,
                [(key, b.num_used / b.num_blocks if b.num_blocks else 0.0)])
    yield gauge("kv_cache_blocks", "The node's KV blocks by state (used + cached + free = total)", ("node", "state"),
                [((s.node_id, state), v) for state, v in (("used", b.num_used), ("cached", b.num_cached),
                                                          ("free", b.num_free))])
    yield from _prefix_cache_families(s)
    yield counter("num_preemptions", "Running sequences preempted to free blocks", node, [(key, e.num_preemptions)])
    yield counter("engine_step_failures", "Engine steps that raised; their requests ended INTERNAL with the error",
                  node, [(key, e.num_step_failures)])
    yield counter("node_generation_tokens", "Tokens the node's engine generated (warm-up included)", node,
                  [(key, e.generated_tokens)])
    yield counter("node_prompt_tokens_computed", "Prompt tokens the node prefilled (cache hits excluded)", node,
                  [(key, e.prompt_tokens_computed)])
    yield counter("node_busy_seconds", "Seconds the engine spent in model steps", node, [(key, e.busy_seconds)])
    if e.intra_op_threads:
        yield gauge("node_intra_op_threads", "CPU threads the engine computes with now (re-decided by timed probes "
                    "unless KVFLEET_CPU_THREADS fixes it)", node, [(key, e.intra_op_threads)])
    if e.queue_time is not None:
        yield histogram("node_request_queue_time_seconds", "Per request, from its arrival at the node to the "
                        "first engine step computing it (block allocation and the step in progress included)",
                        node, [(key, e.queue_time)])
    if e.prefill_time is not None:
        yield histogram("node_request_prefill_time_seconds", "Per request, from its first engine step to the step "
                        "that samples its first token", node, [(key, e.prefill_time)])
    yield from _tier_families(s)
    yield from _fetch_families(s)
    if s.block_sync_calls:
        yield counter("node_block_sync_calls", "block_service calls the engine's step waited on: allocate (no early "
                      "grant fitted) and extend (no reserve block covered the growth)", ("node", "call"),
                      [((s.node_id, call), n) for call, n in s.block_sync_calls])
    yield gauge("node_requests_in_flight", "Request streams open on the node", node, [(key, s.num_in_flight)])
    yield gauge("node_role", "1 for the node's role (mixed, prefill, decode): join on node for per-role figures",
                ("node", "role"), [((s.node_id, s.role), 1)])
    yield gauge("node_group", "1 for the node's group (the configuration it runs: stable, canary): join on node "
                "to compare a canary's figures with the rest", ("node", "group"), [((s.node_id, s.group), 1)])
    yield gauge("node_state", "1 for the node's lifecycle state", ("node", "state"),
                [((s.node_id, s.state), 1)])


def _prefix_cache_families(s: NodeSample) -> Iterator[Metric]:
    """vLLM's prefix-cache queries and hits per tenant (``kv/tenant_lookups.py``), hits by the tier
    they came from; ``sum by (node)`` is the node's figure (its warm-up excluded)."""
    bs, counts = s.block_size, sorted(s.engine.lookups.by_tenant.items())
    yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission (whole "
                  "blocks), per tenant", ("node", "tenant"), [((s.node_id, t), c.queries * bs) for t, c in counts])
    yield counter("prefix_cache_hits", "Of those, tokens not prefilled (whole blocks), per tenant and the tier "
                  "they were found in: device (the pool), host or disk (promoted), peer (fetched from another node "
                  "for this prompt)", ("node", "tenant", "tier"),
                  [((s.node_id, t, tier), n * bs) for t, c in counts for tier, n in c.hits().items()])


def _tier_families(s: NodeSample) -> Iterator[Metric]:
    """The lower KV tiers (kv/tier_index.py): where admission found each block it looked up, and what
    host and disk hold."""
    key, e = (s.node_id,), s.engine
    found = e.lookups
    yield counter("kv_tier_lookups", "Blocks looked up at admission by where they were found: hot (the pool), "
                  "host or disk (promoted, not recomputed), miss (computed)", ("node", "tier"),
                  [((s.node_id, tier), n) for tier, n in (("hot", found.hot), ("host", found.host),
                                                           ("disk", found.disk), ("miss", found.miss))])
    yield counter("num_preemptions_swapped", "Preemptions whose KV was swapped to the host tier, not recomputed",
                  ("node",), [(key, e.num_swapped)])
    if e.tiers is not None:
        t = e.tiers
        yield gauge("kv_tier_blocks", "Blocks held in the node's lower KV tiers (swapped: preempted sequences')",
                    ("node", "tier"), [((s.node_id, tier), n) for tier, n in (("host", t.host_used),
                                                                              ("disk", t.disk_used),
                                                                              ("swapped", t.swapped))])
        yield gauge("kv_tier_capacity_blocks", "Capacity of the node's lower KV tiers, in blocks", ("node", "tier"),
                    [((s.node_id, "host"), t.host_blocks), ((s.node_id, "disk"), t.disk_blocks)])


def _fetch_families(s: NodeSample) -> Iterator[Metric]:
    """Prompt prefixes fetched from peers instead of prefilled (prefix_fetch.py), and the rate the
    fetch-or-prefill decision weighs them against."""
    key, e = (s.node_id,), s.engine
    if e.prefill_tokens_per_s:
        yield gauge("node_prefill_tokens_per_second", "Prefill rate measured on the node's mostly-prefill steps, "
                    "kept current", ("node",), [(key, e.prefill_tokens_per_s)])
    f = s.fetch
    if f is None:
        return
    yield counter("kv_fetch_blocks", "KV blocks fetched from peer nodes instead of prefilled", ("node",),
                  [(key, f.blocks)])
    yield counter("kv_fetch_bytes", "KV bytes fetched from peer nodes (K, V and FP8 scales)", ("node",),
                  [(key, f.bytes)])
    yield histogram("kv_fetch_seconds", "Per fetch from a peer, its whole time (blocks reserved, streamed, "
                    "checked and committed)", ("node",), [(key, f.seconds)])
    yield gauge("kv_fetches_in_flight", "Fetches from peers under way", ("node",), [(key, f.in_flight)])
    yield counter("kv_fetch_decisions", "Prompts a peer held more of: fetched, or prefilled because the fetch "
                  "would cost more (cost), gain too little (small) or is off", ("node", "decision"),
                  [((s.node_id, d), n) for d, n in sorted(f.decisions.items())])
    yield counter("kv_fetch_fallbacks", "Fetches (or lookups) that ended with blocks prefilled instead, by reason",
                  ("node", "reason"), [((s.node_id, r), n) for r, n in sorted(f.fallbacks.items())])


async def sample(node, status, block_size: int, group: str = "stable") -> NodeSample:
    """The node's figures now (a ``NodeContext`` and its ``NodeStatus``, in node group ``group``); run on
    the node's loop."""
    fetch = node.prefix_fetch.figures.reading() if node.prefix_fetch is not None else None
    return NodeSample(status.node_id, status.state.value, block_size, status.num_in_flight, await node.engine_stats(),
                      fetch, status.role, group, tuple(sorted(status.block_sync_calls().items())))
