"""The router's metrics: queue figures per tenant and paid level, latencies and usage per request."""

from __future__ import annotations

import pytest

from kvfleet.core.metric_families import registry_of
from kvfleet.router import metrics
from kvfleet.router.priority_queue import PriorityQueue, QueuedRequest


def test_queue_depth_oldest_wait_and_running_per_tenant():
    q = PriorityQueue(16, capacity=1)
    q.push(QueuedRequest("r1", "gold", 1.0, enqueued_at=10.0), 10.0)
    assert q.pop(10.0).request_id == "r1"  # gold runs; the rest wait for the one slot
    q.push(QueuedRequest("r2", "free", 0.0, enqueued_at=11.0), 11.0)
    q.push(QueuedRequest("r3", "free", 0.0, enqueued_at=12.5), 12.5)
    queues = metrics.tenant_queues(q.waiting(), q.running_by_tenant(), {"gold": 2, "free": 0, "idle": 1}, now=14.0)
    by_tenant = {t.tenant: t for t in queues}
    assert by_tenant["free"] == metrics.TenantQueue("free", 0, num_waiting=2, oldest_wait_s=3.0, num_running=0)
    assert by_tenant["gold"] == metrics.TenantQueue("gold", 2, num_waiting=0, oldest_wait_s=0.0, num_running=1)
    assert by_tenant["idle"].num_waiting == 0  # every tenant on file has a series, zero or not

    r = registry_of(metrics.families(metrics.RouterSample(queues, {("node-0", "kv"): 3, ("node-1", "hot_spot"): 1}, 2)))
    assert r.get_sample_value("kvfleet:router_queue_depth", {"tenant": "free", "paid_level": "0"}) == 2
    assert r.get_sample_value("kvfleet:router_queue_oldest_wait_seconds", {"tenant": "free", "paid_level": "0"}) == 3
    assert r.get_sample_value("kvfleet:router_requests_running", {"tenant": "gold", "paid_level": "2"}) == 1
    assert r.get_sample_value("kvfleet:routing_decisions_total", {"node": "node-0", "reason": "kv"}) == 3
    assert r.get_sample_value("kvfleet:routing_decisions_total", {"node": "node-1", "reason": "hot_spot"}) == 1
    assert r.get_sample_value("kvfleet:router_ready_nodes") == 2


def test_a_request_streamed_token_by_token_counts_one_ttft_and_tokens_minus_one_itls():
    m = metrics.RequestMetrics()
    timer = m.request("gold", arrived=100.0)
    timer.queued(2, 0.5)
    for now in [100.75, 100.8, 100.9, 101.0]:
        timer.tokens(1, now)
    timer.tokens(0, 101.1)  # the last chunk may carry no token
    timer.finished(prompt_tokens=7, completion_tokens=4, cached_tokens=0, reason="length", now=101.1)
    r, t = m.registry, {"tenant": "gold"}
    assert r.get_sample_value("kvfleet:time_to_first_token_seconds_count", t) == 1
    assert r.get_sample_value("kvfleet:time_to_first_token_seconds_sum", t) == pytest.approx(0.75)
    assert r.get_sample_value("kvfleet:inter_token_latency_seconds_count", t) == 3
    assert r.get_sample_value("kvfleet:inter_token_latency_seconds_sum", t) == pytest.approx(0.25)
    assert r.get_sample_value("kvfleet:e2e_request_latency_seconds_sum", t) == pytest.approx(1.1)
    assert r.get_sample_value("kvfleet:router_queue_wait_seconds_count", {"tenant": "gold", "paid_level": "2"}) == 1
    assert r.get_sample_value("kvfleet:prompt_tokens_total", t) == 7
    assert r.get_sample_value("kvfleet:generation_tokens_total", t) == 4
    assert r.get_sample_value("kvfleet:request_success_total", {**t, "finished_reason": "length"}) == 1


def test_a_chunk_of_several_tokens_spreads_its_interval_over_them():
    m = metrics.RequestMetrics()
    timer = m.request("free", arrived=0.0)
    timer.tokens(2, 1.0)   # the first chunk: TTFT, its second token came with it
    timer.tokens(4, 3.0)   # 2 s for 4 tokens: four ITLs of 0.5 s
    r = m.registry
    assert r.get_sample_value("kvfleet:inter_token_latency_seconds_count", {"tenant": "free"}) == 4
    assert r.get_sample_value("kvfleet:inter_token_latency_seconds_bucket", {"tenant": "free", "le": "0.5"}) == 4


def test_latency_buckets_span_a_millisecond_to_a_minute():
    from kvfleet.core.metrics_server import LATENCY_BUCKETS

    assert LATENCY_BUCKETS[0] <= 0.001 and LATENCY_BUCKETS[-1] >= 60
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))


def test_each_ready_node_s_tier_weights_are_gauges():
    sample = metrics.RouterSample([], {}, 2, tier_weights={"node-0": (0.75, 0.5), "node-1": (0.5, 0.25)})
    r = registry_of(metrics.families(sample))
    assert r.get_sample_value("kvfleet:router_node_lower_tier_weight", {"node": "node-0"}) == 0.75
    assert r.get_sample_value("kvfleet:router_node_peer_weight", {"node": "node-0"}) == 0.5
    assert r.get_sample_value("kvfleet:router_node_peer_weight", {"node": "node-1"}) == 0.25
    assert r.get_sample_value("kvfleet:router_node_lower_tier_weight", {"node": "node-2"}) is None
