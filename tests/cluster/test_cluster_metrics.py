"""Every service's /metrics, scraped from a real cluster after real requests: the figures are the
requests' own (their usage, their count) and block_service's own (its Stats answer)."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import pytest
from cluster_helpers import BLOCK_SIZE, random_prompt, request, stream
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.block_service.client import BlockManagerClient

NUM_NODES = 2


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) → value, of one scrape."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def block_stats(address: str):
    async def read():
        async with BlockManagerClient(address) as client:
            return await client.stats()

    return asyncio.run(read())


def test_scraped_counters_are_the_requests_usage(start_cluster):
    cluster = start_cluster(NUM_NODES)
    urls = cluster.metrics_urls
    assert set(urls) == {"block_service", "router", *cluster.nodes}
    nodes_before = {n: scrape(urls[n]) for n in cluster.nodes}

    shared = random_prompt(48, seed=1)  # three full blocks: later requests find them cached
    asks = [("sk-gold", shared + random_prompt(5, seed=2), 6), ("sk-gold", shared + random_prompt(9, seed=3), 4),
            ("sk-free", random_prompt(20, seed=4), 7), ("sk-free", shared, 3), ("sk-gold", random_prompt(3, seed=5), 1)]
    usage = {"gold": [], "free": []}
    first_chunk_tokens = {"gold": 0, "free": 0}  # those come with the first token: no interval between them
    for key, prompt, max_tokens in asks:
        chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=max_tokens, ignore_eos=True), key)
        usage[key.removeprefix("sk-")].append(chunks[-1].usage)
        first_chunk_tokens[key.removeprefix("sk-")] += len(next(c for c in chunks if c.token_ids).token_ids)
    assert sum(u.cached_tokens for us in usage.values() for u in us) > 0  # the shared prefix was found

    router = scrape(urls["router"])
    for tenant, us in usage.items():
        assert total(router, "kvfleet:prompt_tokens_total", tenant=tenant) == sum(u.prompt_tokens for u in us)
        assert total(router, "kvfleet:generation_tokens_total", tenant=tenant) == sum(u.completion_tokens for u in us)
        assert total(router, "kvfleet:prompt_tokens_cached_total", tenant=tenant) == sum(u.cached_tokens for u in us)
        assert total(router, "kvfleet:request_success_total", tenant=tenant, finished_reason="length") == len(us)
        for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            assert total(router, f"kvfleet:{histogram}_count", tenant=tenant) == len(us)
        # every token after the first chunk is one inter-token latency (a node that falls behind
        # its stream sends the tokens it has in one chunk)
        assert total(router, "kvfleet:inter_token_latency_seconds_count", tenant=tenant) \
            == sum(u.completion_tokens for u in us) - first_chunk_tokens[tenant]
        assert total(router, "kvfleet:router_queue_wait_seconds_count", tenant=tenant) == len(us)
    assert total(router, "kvfleet:routing_decisions_total") == len(asks)  # no failover: one decision each
    assert total(router, "kvfleet:router_ready_nodes") == NUM_NODES
    assert total(router, "kvfleet:router_queue_depth") == 0

    generated = sum(u.completion_tokens for us in usage.values() for u in us)
    nodes_after = {n: scrape(urls[n]) for n in cluster.nodes}
    delta = sum(total(nodes_after[n], "kvfleet:node_generation_tokens_total")
                - total(nodes_before[n], "kvfleet:node_generation_tokens_total") for n in cluster.nodes)
    assert delta == generated
    for phase in ("queue", "prefill"):  # one per request on the node that served it (warm-up's before)
        timed = sum(total(nodes_after[n], f"kvfleet:node_request_{phase}_time_seconds_count")
                    - total(nodes_before[n], f"kvfleet:node_request_{phase}_time_seconds_count") for n in cluster.nodes)
        assert timed == len(asks)
    for n, samples in nodes_after.items():
        assert total(samples, "kvfleet:node_state", node=n, state="READY") == 1
        assert total(samples, "kvfleet:num_requests_running", node=n) == 0


def test_block_service_figures_are_its_stats(start_cluster):
    cluster = start_cluster(1)
    # a prompt of five blocks for a tenant allowed three: refused for its quota
    with pytest.raises(grpc.RpcError) as refused:
        stream(cluster.router_address, request(tokens=random_prompt(80, seed=6), max_tokens=2), "sk-tiny")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stream(cluster.router_address, request(tokens=random_prompt(40, seed=7), max_tokens=3), "sk-gold")

    # a node gives its blocks back just after the last chunk: wait until block_service holds no sequence
    deadline = time.monotonic() + 60
    while (stats := block_stats(cluster.block_service_address)) and any(n.num_sequences for n in stats[0]):
        assert time.monotonic() < deadline, stats[0]
        time.sleep(0.2)
    samples = scrape(cluster.metrics_urls["block_service"])
    nodes, tenants = block_stats(cluster.block_service_address)
    assert (nodes, tenants) == stats  # nothing moved while it was scraped
    assert {n.node_id for n in nodes} == set(cluster.nodes)
    for n in nodes:
        for state, value in (("used", n.num_used), ("cached", n.num_cached), ("free", n.num_free)):
            assert total(samples, "kvfleet:pool_blocks", node=n.node_id, state=state) == value
    assert sum(n.num_cached for n in nodes) > 0  # the gold request's committed blocks stay cached
    for t in tenants:
        labels = {"tenant": t.tenant, "node": t.node_id}
        assert total(samples, "kvfleet:tenant_blocks_charged", **labels) == t.blocks_charged
        if t.blocks_allowed is not None:
            assert total(samples, "kvfleet:tenant_blocks_quota", **labels) == t.blocks_allowed
        assert total(samples, "kvfleet:block_refusals_total", reason="quota", **labels) == t.counters.refusals_quota
    assert total(samples, "kvfleet:block_refusals_total", tenant="tiny", reason="quota") > 0
    assert total(samples, "kvfleet:block_service_operations_total", operation="RegisterNode") >= 1
    assert total(samples, "kvfleet:block_service_operations_total", operation="Stats") >= 1
    assert total(samples, "kvfleet:wal_fsync_seconds_count") > 0
    assert total(samples, "kvfleet:snapshot_age_seconds") >= 0


def test_a_nodes_prefix_cache_is_counted_per_tenant_and_tier(start_cluster):
    """The same prompt twice per tenant on one node: each tenant's second finds its first's whole
    blocks (hits = queries of one request), never the other tenant's (their chains are salted
    apart); the warm-up is no tenant; all tenants together are what the page table counted."""
    cluster = start_cluster(1)
    (node,) = cluster.nodes
    url = cluster.metrics_urls[node]
    before, pool_before = scrape(url), block_stats(cluster.block_service_address)[0][0].counters
    prompt = random_prompt(3 * BLOCK_SIZE + 5, seed=8)  # three full blocks looked up, the rest computed
    cached = [stream(cluster.router_address, request(tokens=prompt, max_tokens=2), key)[-1].usage.cached_tokens
              for key in ("sk-gold", "sk-gold", "sk-free", "sk-free")]
    after, pool_after = scrape(url), block_stats(cluster.block_service_address)[0][0].counters

    def delta(name: str, **labels: str) -> float:
        return total(after, name, node=node, **labels) - total(before, name, node=node, **labels)

    assert cached == [0, 3 * BLOCK_SIZE] * 2
    for tenant in ("gold", "free"):
        assert delta("kvfleet:prefix_cache_queries_total", tenant=tenant) == 2 * 3 * BLOCK_SIZE
        assert [delta("kvfleet:prefix_cache_hits_total", tenant=tenant, tier=tier)
                for tier in ("device", "host", "disk", "peer")] == [3 * BLOCK_SIZE, 0, 0, 0]
    assert not any(dict(labels).get("tenant") == "__warmup__" for _, labels in after)
    assert delta("kvfleet:prefix_cache_queries_total") == (pool_after.prefix_queries - pool_before.prefix_queries) \
        * BLOCK_SIZE
    assert delta("kvfleet:prefix_cache_hits_total") == (pool_after.prefix_hits - pool_before.prefix_hits) * BLOCK_SIZE
