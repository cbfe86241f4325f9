"""Per-tenant prefix-cache lookups as real engines count them: a prefix fetched from a peer is the
peer's at its first hit and the pool's after; a lower tier's promotions are the host's; another
tenant's same prompt hits nothing (two real engines and a real gRPC holder on loopback)."""

from __future__ import annotations

from kvfleet.compute_service.kv.tenant_lookups import TenantLookups
from tests.compute_service.kv_peers import OTHERS, PROMPT, fetch, hashes_of, make_engine, per_block, serve

HASHES = hashes_of(PROMPT, "default", 4)


def test_a_fetched_prefix_is_the_peers_at_its_first_hit_and_the_pools_after(llama_dir):
    holder, receiver = make_engine(llama_dir), make_engine(llama_dir)
    serve(holder, PROMPT)
    assert fetch(holder, receiver, "default", HASHES) == 4
    assert serve(receiver, PROMPT).cached_tokens == serve(receiver, PROMPT).cached_tokens > 0
    serve(receiver, PROMPT, tenant="other")
    lookups = receiver.stats().lookups.by_tenant
    assert lookups == {"default": TenantLookups(queries=8, device=4, peer=4), "other": TenantLookups(queries=4)}
    assert receiver.stats().blocks.prefix_hits >= 8  # the page table saw those hits as its own


def test_blocks_promoted_from_the_host_tier_are_the_hosts(llama_dir):
    engine = make_engine(llama_dir, 8, kv_host_memory=32 * per_block(llama_dir))
    serve(engine, PROMPT)
    for other in OTHERS:  # an 8-block pool: PROMPT's blocks are demoted to host
        serve(engine, other)
    serve(engine, PROMPT)
    got = engine.stats().lookups.by_tenant["default"]
    assert (got.host, got.device, got.peer) == (4, 0, 0)
    assert got.queries == 4 + 4 + sum((len(o) - 1) // 16 for o in OTHERS)
