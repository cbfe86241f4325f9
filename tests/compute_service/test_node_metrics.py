"""A node's metrics are its engine's figures under vLLM's names, in vLLM's units."""

from __future__ import annotations

from dataclasses import replace

from kvfleet.compute_service.engine.stats import EngineStats
from kvfleet.compute_service.node import metrics
from kvfleet.core.allocator import AllocatorStats
from kvfleet.core.metric_families import registry_of


def _sample(block_size: int = 16, **engine) -> metrics.NodeSample:
    figures = dict(num_running=2, num_waiting=1, max_num_seqs_live=0, num_preemptions=4, generated_tokens=120,
                   prompt_tokens_computed=300, busy_seconds=1.5,
                   blocks=AllocatorStats(num_blocks=64, num_free=40, num_cached=8, num_used=16, prefix_queries=10,
                                         prefix_hits=6))
    return metrics.NodeSample("node-0", "READY", block_size, 3, EngineStats(**{**figures, **engine}))


def test_vllm_names_carry_the_engine_figures():
    r = registry_of(metrics.families(_sample()))
    node = {"node": "node-0"}
    assert r.get_sample_value("kvfleet:num_requests_running", node) == 2
    assert r.get_sample_value("kvfleet:num_requests_waiting", node) == 1
    assert r.get_sample_value("kvfleet:kv_cache_usage_perc", node) == 16 / 64
    assert r.get_sample_value("kvfleet:num_preemptions_total", node) == 4
    assert r.get_sample_value("kvfleet:node_generation_tokens_total", node) == 120
    assert r.get_sample_value("kvfleet:node_prompt_tokens_computed_total", node) == 300
    assert r.get_sample_value("kvfleet:node_state", {**node, "state": "READY"}) == 1


def test_prefix_cache_counts_tokens_of_whole_blocks_per_tenant_and_tier():
    from kvfleet.compute_service.kv.tenant_lookups import TenantLookups
    from kvfleet.compute_service.kv.tier_index import PrefixLookups

    lookups = PrefixLookups(by_tenant={"a": TenantLookups(queries=10, device=4, host=1, disk=0, peer=1),
                                       "b": TenantLookups(queries=3)})
    r = registry_of(metrics.families(_sample(block_size=32, lookups=lookups)))
    a, b = {"node": "node-0", "tenant": "a"}, {"node": "node-0", "tenant": "b"}
    assert r.get_sample_value("kvfleet:prefix_cache_queries_total", a) == 10 * 32
    assert r.get_sample_value("kvfleet:prefix_cache_queries_total", b) == 3 * 32
    assert [r.get_sample_value("kvfleet:prefix_cache_hits_total", {**a, "tier": t})
            for t in ("device", "host", "disk", "peer")] == [4 * 32, 32, 0, 32]
    assert r.get_sample_value("kvfleet:prefix_cache_hits_total", {**b, "tier": "device"}) == 0


def test_blocks_by_state_add_up_and_an_empty_pool_is_not_a_division_by_zero():
    r = registry_of(metrics.families(_sample()))
    assert sum(r.get_sample_value("kvfleet:kv_cache_blocks", {"node": "node-0", "state": s})
               for s in ("used", "cached", "free")) == 64
    empty = AllocatorStats(num_blocks=0, num_free=0, num_cached=0, num_used=0, prefix_queries=0, prefix_hits=0)
    r = registry_of(metrics.families(_sample(blocks=empty)))
    assert r.get_sample_value("kvfleet:kv_cache_usage_perc", {"node": "node-0"}) == 0


def test_the_live_cap_is_a_gauge():
    r = registry_of(metrics.families(_sample(max_num_seqs_live=7)))
    assert r.get_sample_value("kvfleet:max_num_seqs_live", {"node": "node-0"}) == 7


def test_the_cpu_thread_count_is_a_gauge_only_on_cpu():
    r = registry_of(metrics.families(_sample(intra_op_threads=2)))
    assert r.get_sample_value("kvfleet:node_intra_op_threads", {"node": "node-0"}) == 2
    r = registry_of(metrics.families(_sample()))
    assert r.get_sample_value("kvfleet:node_intra_op_threads", {"node": "node-0"}) is None


def test_lower_tier_lookups_and_blocks_are_exported():
    from kvfleet.compute_service.kv.tier_index import PrefixLookups, TierCounts

    r = registry_of(metrics.families(_sample(lookups=PrefixLookups(hot=5, host=3, disk=2, miss=7),
                                             tiers=TierCounts(100, 400, 30, 90, 4), num_swapped=2)))
    node = {"node": "node-0"}
    assert [r.get_sample_value("kvfleet:kv_tier_lookups_total", {**node, "tier": t})
            for t in ("hot", "host", "disk", "miss")] == [5, 3, 2, 7]
    assert r.get_sample_value("kvfleet:kv_tier_blocks", {**node, "tier": "disk"}) == 90
    assert r.get_sample_value("kvfleet:kv_tier_blocks", {**node, "tier": "swapped"}) == 4
    assert r.get_sample_value("kvfleet:kv_tier_capacity_blocks", {**node, "tier": "host"}) == 100
    assert r.get_sample_value("kvfleet:num_preemptions_swapped_total", node) == 2


def test_queue_and_prefill_times_are_histograms():
    from kvfleet.core.latency_histogram import LatencyHistogram

    queue, prefill = LatencyHistogram(), LatencyHistogram()
    queue.observe(0.3)
    prefill.observe(0.05)
    prefill.observe(2.0)
    r = registry_of(metrics.families(_sample(queue_time=queue.snapshot(), prefill_time=prefill.snapshot())))
    node = {"node": "node-0"}
    assert r.get_sample_value("kvfleet:node_request_queue_time_seconds_count", node) == 1
    assert r.get_sample_value("kvfleet:node_request_prefill_time_seconds_bucket", {**node, "le": "0.05"}) == 1
    assert r.get_sample_value("kvfleet:node_request_prefill_time_seconds_sum", node) == 2.05


def test_block_service_calls_a_step_waited_on_are_counted_by_call():
    sample = _sample()
    assert registry_of(metrics.families(sample)).get_sample_value(
        "kvfleet:node_block_sync_calls_total", {"node": "node-0", "call": "extend"}) is None  # in-process pool
    r = registry_of(metrics.families(replace(sample, block_sync_calls=(("allocate", 3), ("extend", 1)))))
    assert r.get_sample_value("kvfleet:node_block_sync_calls_total", {"node": "node-0", "call": "allocate"}) == 3
    assert r.get_sample_value("kvfleet:node_block_sync_calls_total", {"node": "node-0", "call": "extend"}) == 1
