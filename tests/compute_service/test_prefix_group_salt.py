"""Prefix groups on a node: a sequence's chain is salted with its group (kv/cache_manager.py), so a
group mate's committed prefix is a cache hit and an outsider's is not; the holder of a peer fetch
serves a block under the asker's salt (node/kv_holder.same_salt), never across groups; block_service
charges a shared block once, to the tenant that made it. No processes."""

from __future__ import annotations

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.compute_service.kv.held_run import leading_run
from kvfleet.compute_service.node.kv_holder import same_salt
from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from kvfleet.core.sampling import SamplingParams

BS = 16
PROMPT = list(range(1, 3 * BS + 2))  # 3 full blocks and a token


def served(kv: KVCacheManager, tenant: str, group: str = "") -> Sequence:
    """``tenant``'s request for PROMPT, admitted, prefilled and its full blocks committed."""
    seq = Sequence(f"{tenant}-{len(kv.prefix_groups)}-{id(kv)}", list(PROMPT), SamplingParams(), tenant=tenant,
                   prefix_group=group)
    assert kv.allocate(seq) is None
    seq.num_cached_tokens = seq.num_computed
    seq.num_computed = seq.num_tokens
    kv.commit_full_blocks([seq])
    return seq


def manager() -> KVCacheManager:
    return KVCacheManager(LocalBlockAllocator.standalone(64, BS, bytes_per_block=1024))


def test_a_group_mate_hits_the_prefix_and_an_outsider_does_not():
    kv = manager()
    first = served(kv, "a", "org")
    assert first.num_cached_tokens == 0
    assert served(kv, "b", "org").num_cached_tokens == 3 * BS  # a's blocks, under the group's salt
    assert served(kv, "c").num_cached_tokens == 0               # no group: its own salt
    assert served(kv, "d", "other").num_cached_tokens == 0      # another group: another salt
    assert served(kv, "org").num_cached_tokens == 0             # a tenant named like the group
    assert first.block_hashes == block_hashes(PROMPT, BS, tenant_extra_key("x", prefix_group="org"), kv.seed)[:3]


def test_without_a_group_tenants_stay_isolated_and_sharing_by_config_still_shares():
    kv = manager()
    served(kv, "a")
    assert served(kv, "b").num_cached_tokens == 0
    assert served(kv, "a").num_cached_tokens == 3 * BS
    shared = KVCacheManager(LocalBlockAllocator.standalone(64, BS, bytes_per_block=1024), share_prefix_across_tenants=True)
    served(shared, "a", "org")
    assert served(shared, "c").num_cached_tokens == 3 * BS


def test_the_holder_serves_a_block_under_the_askers_salt_only():
    kv = manager()
    served(kv, "a", "org")
    served(kv, "c")
    group_chain = block_hashes(PROMPT, BS, tenant_extra_key("a", prefix_group="org"), kv.seed)[:3]
    c_chain = block_hashes(PROMPT, BS, tenant_extra_key("c"), kv.seed)[:3]

    def run(chain, tenant, group=""):
        return leading_run(chain, tenant, kv.usage.find, lambda _: None, 99, same_salt(kv, tenant, group))

    assert len(run(group_chain, "b", "org").blocks) == 3   # a group mate asks with the group: served
    assert len(run(group_chain, "a", "org").blocks) == 3
    fenced = run(group_chain, "b")                          # b not saying its group: another salt
    assert fenced.blocks == [] and fenced.fenced_at == 0
    assert run(group_chain, "d", "other").fenced_at == 0    # across groups: never
    assert run(c_chain, "b", "org").fenced_at == 0          # an isolated tenant's blocks: never to a group
    assert len(run(c_chain, "c").blocks) == 3
    assert kv.salt_of("a") == tenant_extra_key("b", prefix_group="org") != kv.salt_of("c")


def test_a_shared_block_is_charged_once_to_the_tenant_that_made_it():
    """block_service knows hashes, not salts: a group mate's hit is the shared-prefix rule (charged
    once, to its maker, while anyone holds it; nothing left charged once all let go)."""
    kv = manager()
    a = served(kv, "a", "org")
    b = served(kv, "b", "org")
    table, node = kv.allocator.page_table, kv.allocator.node_id

    def charged():
        return {s.tenant: s.blocks_charged for s in table.tenant_stats(node) if s.blocks_charged}

    assert charged() == {"a": 4, "b": 1}  # b: its own last block only
    kv.release([a])
    assert charged() == {"a": 3, "b": 1}  # the shared 3 stay a's while b holds them
    kv.release([b])
    assert charged() == {}
    table.check()
