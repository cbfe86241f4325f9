"""Pins through the whole cluster, as separate processes: a tenant pins its system prompt through the
router (``cache.pin``), another tenant floods the node's small pool with unique prompts, and the
pinned prompt is still a cache hit afterwards while an unpinned one of the same tenant was evicted;
a pin past the tenant's budget, and one by a tenant without a budget, are refused with their status
and block_service's line, and nothing runs."""

from __future__ import annotations

import asyncio

import grpc
import httpx2 as httpx
import pytest
from cluster_helpers import BLOCK_SIZE, random_prompt, request, stream

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.settings import EvictionSettings
from kvfleet.cli.demo_tenants import DEMO_TENANTS
from kvfleet.v1 import inference_pb2

# the test model in float32: 2 x 4 layers x 2 KV heads x 32 x 16 tokens x 4 bytes = 32 KiB a block;
# a 1 MiB pool holds 32 blocks, and 0.25 MiB of pins is 8 of them
TENANTS = DEMO_TENANTS.replace("    quota_mib: 256\n", "    quota_mib: 256\n    pinned_mib: 0.25\n")
SYSTEM_BLOCKS = 6


def usage(chunks) -> inference_pb2.Usage:
    return chunks[-1].usage


def pinned(prompt, tokens: int = 0, ttl_s: int = 0):
    req = request(tokens=prompt, max_tokens=2)
    req.cache.pin, req.cache.pin_tokens, req.cache.pin_ttl_s = True, tokens, ttl_s
    return req


def pins_of(cluster) -> list:
    async def read():
        async with BlockManagerClient(cluster.block_service_address) as client:
            return (await client.blocks()).pins

    return asyncio.run(read())


def test_a_pinned_system_prompt_survives_another_tenants_flood(start_cluster, tmp_path):
    tenants = tmp_path / "pins.yaml"
    tenants.write_text(TENANTS)
    # LRU: the policy that protects nobody (fair would keep gold's blocks from the flood by itself)
    cluster = start_cluster(1, kv_cache_memory=1 << 20, tenants_file=tenants,
                            eviction=EvictionSettings(eviction_policy="lru"))
    system = random_prompt(SYSTEM_BLOCKS * BLOCK_SIZE + 3, seed=71)
    other = random_prompt(SYSTEM_BLOCKS * BLOCK_SIZE + 3, seed=72)  # the same tenant's, unpinned

    first = stream(cluster.router_address, pinned(system, ttl_s=600))
    assert usage(first).pinned_tokens == SYSTEM_BLOCKS * BLOCK_SIZE and usage(first).cached_tokens == 0
    stream(cluster.router_address, request(tokens=other, max_tokens=2))
    [pin] = pins_of(cluster)
    assert (pin.tenant, pin.pinned, pin.allowed, pin.cached) == ("gold", SYSTEM_BLOCKS, 8, SYSTEM_BLOCKS)

    for i in range(6):  # 6 x 10 blocks through a pool of 32: every unpinned cached block goes
        flood = random_prompt(10 * BLOCK_SIZE, seed=100 + i)
        stream(cluster.router_address, request(tokens=flood, max_tokens=2), api_key="sk-free")

    again = stream(cluster.router_address, request(tokens=other, max_tokens=2))
    assert usage(again).cached_tokens == 0, "the flood did not evict the unpinned prompt: it proves nothing"
    hit = stream(cluster.router_address, request(tokens=system, max_tokens=2))
    assert usage(hit).cached_tokens == SYSTEM_BLOCKS * BLOCK_SIZE and usage(hit).pinned_tokens == 0

    # the same pin again refreshes it, charging nothing; past the budget the whole pin is refused
    assert usage(stream(cluster.router_address, pinned(system))).pinned_tokens == SYSTEM_BLOCKS * BLOCK_SIZE
    longer = random_prompt(4 * BLOCK_SIZE, seed=73)
    with pytest.raises(grpc.RpcError) as err:
        stream(cluster.router_address, pinned(longer))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'gold' may pin 8 blocks (pinned_mib 0.25) on node 'node-0'; 6 pinned, this pin needs 4 more" in \
        err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stream(cluster.router_address, pinned(longer), api_key="sk-free")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "pinned_mib" in err.value.details()
    [pin] = pins_of(cluster)
    assert (pin.tenant, pin.pinned) == ("gold", SYSTEM_BLOCKS)

    # the HTTP door: kvfleet_pin pins (a refresh here), a bad one is 400 naming it, past the budget 429
    key = {"authorization": "Bearer sk-gold"}
    model = httpx.get(cluster.http_url + "/models", headers=key).json()["data"][0]["id"]

    def post(pin):
        return httpx.post(cluster.http_url + "/completions", headers=key, timeout=120,
                          json={"model": model, "prompt": system, "max_tokens": 1, "kvfleet_pin": pin})

    answer = post({"ttl_s": 600})
    assert answer.status_code == 200 and answer.json()["usage"]["kvfleet_pinned_tokens"] == SYSTEM_BLOCKS * BLOCK_SIZE
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == SYSTEM_BLOCKS * BLOCK_SIZE
    bad = post("always")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kvfleet_pin"
    over = httpx.post(cluster.http_url + "/completions", headers=key, timeout=120,
                      json={"model": model, "prompt": longer, "max_tokens": 1, "kvfleet_pin": True})
    assert over.status_code == 429 and "this pin needs 4 more" in over.json()["error"]["message"]
