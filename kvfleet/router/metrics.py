"""The router's Prometheus metrics: requests as their clients lived them, the queue, the routing.

    sampled at scrape time (on the loop)   observed as they happen (thread-safe prometheus metrics)
    ────────────────────────────────────   ─────────────────────────────────────────────────────────
    queue depth, oldest wait, running      TTFT, inter-token latency, end-to-end latency, queue wait
      per tenant and paid level            prompt / generation / cached tokens from each usage,
    routing decisions by node and reason     finished requests by reason
    each READY node's tier weights

The router sees a request's whole life (queueing, failover, resumption), so the request-level
figures are vLLM's names here: ``kvfleet:time_to_first_token_seconds`` and the rest, the token
counters taken from the very usage the client receives. Latencies are measured from the request's
arrival at the router (queueing included, as vLLM measures from arrival at the engine). Labels are
tenant names, paid levels, node ids and reasons: all bounded by configuration.

Pure: clocks are passed in; the gRPC stream glue is in ``kvfleet/router/generation.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from kvfleet.core.latency_histogram import HistogramSnapshot
from kvfleet.core.metric_families import PREFIX, counter, gauge, histogram
from kvfleet.core.metrics_server import LATENCY_BUCKETS
from kvfleet.router.priority_queue import QueuedRequest


@dataclass(slots=True, frozen=True)
class TenantQueue:
    tenant: str
    paid_level: int
    num_waiting: int
    oldest_wait_s: float   # 0 when none waits
    num_running: int


@dataclass(slots=True, frozen=True)
class RouterSample:
    tenants: list[TenantQueue]
    decisions: dict[tuple[str, str], int]   # (node id, reason) → routing decisions
    num_ready_nodes: int
    capacity: int | None = None             # requests run at once (None: no limit)
    tier_weights: dict[str, tuple[float, float]] = field(default_factory=dict)  # READY node → (l, p) in its cost
    ready_by_role: dict[str, int] = field(default_factory=dict)  # kvfleet.core.roles → READY nodes
    handovers: int = 0                                            # prefill → decode hand-overs begun
    handover_seconds: HistogramSnapshot | None = None


def tenant_queues(waiting: Iterable[QueuedRequest], running: Mapping[str, int], paid_levels: Mapping[str, int],
                  now: float) -> list[TenantQueue]:
    """Per tenant on file: how many wait, how long the oldest has, how many run."""
    count = dict.fromkeys(paid_levels, 0)
    oldest: dict[str, float] = {}
    for q in waiting:
        count[q.tenant] = count.get(q.tenant, 0) + 1
        oldest.setdefault(q.tenant, q.enqueued_at)  # arrival order: the first is the oldest
    return [TenantQueue(t, paid_levels.get(t, 0), n, max(now - oldest[t], 0.0) if t in oldest else 0.0,
                        running.get(t, 0)) for t, n in count.items()]


def families(s: RouterSample) -> Iterator[Metric]:
    labels = ("tenant", "paid_level")
    yield gauge("router_queue_depth", "Requests waiting in the router's queue", labels,
                [((q.tenant, str(q.paid_level)), q.num_waiting) for q in s.tenants])
    yield gauge("router_queue_oldest_wait_seconds", "How long the oldest waiting request has waited", labels,
                [((q.tenant, str(q.paid_level)), q.oldest_wait_s) for q in s.tenants])
    yield gauge("router_requests_running", "Requests admitted and not finished", labels,
                [((q.tenant, str(q.paid_level)), q.num_running) for q in s.tenants])
    yield counter("routing_decisions", "Requests (and failover attempts) routed, by node and reason "
                  "(kv: lowest KV-aware cost; hot_spot: least loaded instead; warmup: a warming node left out)",
                  ("node", "reason"), [((node, reason), n) for (node, reason), n in sorted(s.decisions.items())])
    yield gauge("router_ready_nodes", "Compute nodes READY for requests", (), [((), s.num_ready_nodes)])
    yield gauge("router_ready_nodes_by_role", "Compute nodes READY, per role (mixed, prefill, decode)", ("role",),
                [((role,), n) for role, n in sorted(s.ready_by_role.items())])
    yield counter("router_handovers", "Requests prefilled on a prefill node and handed to a decode node", (),
                  [((), s.handovers)])
    if s.handover_seconds is not None:
        yield histogram("router_handover_seconds", "Per hand-over, from the prefill node's first token to the decode "
                        "node's next one (its KV fetch included)", (), [((), s.handover_seconds)])
    weights = sorted(s.tier_weights.items())
    yield gauge("router_node_lower_tier_weight", "What a prompt block a node holds in a lower tier is worth against "
                "a hot one in its routing cost (l): from its measured copy and prefill rates, else "
                "--lower-tier-hit-weight", ("node",), [((node,), lw) for node, (lw, _) in weights])
    yield gauge("router_node_peer_weight", "What a prompt block only another node holds (fetched) is worth against "
                "a hot one in a node's routing cost (p): from its measured fetch and prefill rates, else "
                "--peer-hit-weight", ("node",), [((node,), pw) for node, (_, pw) in weights])
    yield gauge("router_capacity", "Requests the router lets run at once: the READY nodes' live caps summed, "
                "or --capacity (no series: no limit)", (), [] if s.capacity is None else [((), s.capacity)])


class RequestMetrics:
    """What is observed per request; one per router, shared by both doors."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = registry or CollectorRegistry()
        tenant = ["tenant"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "From arrival to the first token",
                              tenant, buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between successive tokens of a request",
                             tenant, buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "From arrival to the last token",
                             tenant, buckets=LATENCY_BUCKETS, registry=registry)
        self.queue_wait = Histogram(PREFIX + "router_queue_wait_seconds", "Time in the router's queue",
                                    ["tenant", "paid_level"], buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests (usage)",
                                     tenant, registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens",
                                         "Completion tokens of finished requests (usage)", tenant, registry=registry)
        self.cached_tokens = Counter(PREFIX + "prompt_tokens_cached",
                                     "Prompt tokens served from a node's prefix cache (usage)", tenant,
                                     registry=registry)
        self.success = Counter(PREFIX + "request_success", "Finished requests by finish reason",
                               ["tenant", "finished_reason"], registry=registry)

    def request(self, tenant: str, arrived: float) -> RequestTimer:
        return RequestTimer(self, tenant, arrived)


class RequestTimer:
    """One request's clock: ``tokens`` for each chunk with tokens, ``finished`` with its usage.

    TTFT is observed at the first chunk with tokens; every later token counts one inter-token
    latency (a chunk of n tokens arriving dt after the previous one: n observations of dt/n), so a
    request streamed token by token has ``completion_tokens - 1`` of them, as in vLLM.
    """

    __slots__ = ("metrics", "tenant", "arrived", "last")

    def __init__(self, metrics: RequestMetrics, tenant: str, arrived: float) -> None:
        self.metrics = metrics
        self.tenant = tenant
        self.arrived = arrived
        self.last: float | None = None  # when the previous tokens arrived

    def queued(self, paid_level: int, seconds: float) -> None:
        self.metrics.queue_wait.labels(self.tenant, str(paid_level)).observe(seconds)

    def tokens(self, n: int, now: float) -> None:
        if n <= 0:
            return
        if self.last is None:
            self.metrics.ttft.labels(self.tenant).observe(now - self.arrived)
        else:
            itl = self.metrics.itl.labels(self.tenant)
            for _ in range(n):
                itl.observe((now - self.last) / n)
        self.last = now

    def finished(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int, reason: str,
                 now: float) -> None:
        m, t = self.metrics, self.tenant
        m.e2e.labels(t).observe(now - self.arrived)
        m.prompt_tokens.labels(t).inc(prompt_tokens)
        m.generation_tokens.labels(t).inc(completion_tokens)
        m.cached_tokens.labels(t).inc(cached_tokens)
        m.success.labels(t, reason).inc()
