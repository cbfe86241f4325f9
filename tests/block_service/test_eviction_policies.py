"""What each eviction policy chooses, through the page table: a flooding tenant loses its own blocks
first under ``fair``, ``value`` keeps a often hit long prefix over a fresh one, ties go to the block
cached first, the clock ages what nobody hits; each against ``lru`` on the same calls, so that the
difference is the policy's. Evictions are counted per tenant and reason, and a restored policy
evicts what the live one does."""

from __future__ import annotations

import hashlib

import pytest

from kvfleet.block_service import metrics
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.eviction import NAMES, POLICIES
from kvfleet.block_service.eviction.fair import furthest_over
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import recover
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.metric_families import registry_of
from kvfleet.core.tenants import MIB, Tenant

BS = 16
BPB = MIB // 4  # four blocks per MiB


def chain(name: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{name}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def request(table: PageTable | DurablePageTable, seq: str, tenant: str, hashes: list[bytes]) -> list[int]:
    """A whole request: allocate (its cached prefix revived), commit, release; its block ids."""
    got = table.allocate_many([AllocateRequest("n", seq, tenant, hashes, len(hashes) * BS)])[0]
    assert isinstance(got, Allocation), got
    table.commit([(seq, i, h) for i, h in enumerate(hashes)])
    table.release([seq])
    return got.block_ids


class Calls:
    """A one-node table under ``policy`` and the request-shaped calls the tests make on it."""

    def __init__(self, policy: str, num_blocks: int, tenants: list[Tenant] = ()) -> None:
        self.table = PageTable(policy)
        self.table.register_node("n", num_blocks, BS, BPB)
        self.table.configure_tenants(tenants)
        self.count = 0

    def request(self, tenant: str, hashes: list[bytes]) -> list[int]:
        self.count += 1
        blocks = request(self.table, f"s{self.count}", tenant, hashes)
        self.table.check()
        return blocks

    def cached_run(self, hashes: list[bytes]) -> int:
        return self.table.match_prefix(hashes)["n"]


def flood(policy: str) -> Calls:
    """Tenant a (a share of 4 blocks) caches a 4-block system prompt and hits it; then b (no share)
    sends unique 4-block prompts that fill the 16-block pool twice over."""
    calls = Calls(policy, 16, [Tenant("a", cache_share_mib=1), Tenant("b")])
    system = chain("a-system", 4)
    for _ in range(3):
        calls.request("a", system)
    for k in range(8):
        calls.request("b", chain(f"b-{k}", 4))
    return calls


def test_fair_a_flood_by_a_tenant_without_a_share_evicts_its_own_blocks_first() -> None:
    system = chain("a-system", 4)
    for policy in ("fair", "fair+value"):
        calls = flood(policy)
        assert calls.cached_run(system) == 4, f"{policy}: a's prompt, within its share, was evicted"
        assert calls.table.node_stats("n").num_cached == 16
        assert calls.table.node_stats("n").counters.evictions == {"over_share": 20}  # 32 blocks asked, 12 free
        per = {t.tenant: t.counters.evictions for t in calls.table.tenant_stats("n")}
        assert per["b"] == {"over_share": 20} and per["a"] == {}
    lru = flood("lru")
    assert lru.cached_run(system) == 0, "the LRU keeps a's prompt too: the flood above proves nothing"
    assert {t.tenant: t.counters.evictions for t in lru.table.tenant_stats("n")}["a"] == {"lru": 4}


def test_fair_the_tenant_furthest_over_its_share_goes_first() -> None:
    # a holds 6 of a share of 2 (3x), b holds 4 of 4 (1x): a's least recently used first, though b's is older
    calls = Calls("fair", 12, [Tenant("a", cache_share_mib=0.5), Tenant("b", cache_share_mib=1)])
    b_blocks = calls.request("b", chain("b", 4))
    a_blocks = calls.request("a", chain("a", 6))
    victims = calls.table.next_victims("n", 10)
    assert victims[:4] == a_blocks[::-1][:4], "a's deepest first until a is down to b's ratio"
    # then a at 2/2 = 1 and b at 4/4 = 1 tie: the one holding more cached blocks (b) goes first
    assert victims[4] == b_blocks[-1]
    got = calls.table.allocate("n", "x", "c", [], 12 * BS)
    assert isinstance(got, Allocation) and got.block_ids[2:] == victims  # the two free blocks, then as announced
    evictions = {t.tenant: t.counters.evictions for t in calls.table.tenant_stats("n")}
    assert evictions["a"] == {"over_share": 4, "within_share": 2}  # down to its share, then within it
    assert evictions["b"] == {"within_share": 4}


def test_furthest_over_compares_ratios_exactly_and_breaks_ties_by_size_then_name() -> None:
    names = ["a", "b", "c"]
    assert furthest_over([3, 5, 0], [1, 2, 0], names) == 0          # 3/1 > 5/2
    assert furthest_over([2, 4, 1], [1, 2, 0], names) == 2          # no share: before any share
    assert furthest_over([2, 4, 0], [1, 2, 0], names) == 1          # 2/1 == 4/2: more held
    assert furthest_over([4, 4, 0], [2, 2, 0], names) == 0          # all equal: the name
    assert furthest_over([1, 7, 3], [0, 0, 0], names) == 1          # no shares at all: the largest holder
    assert furthest_over([0, 0, 3], [5, 5, 1], names) == 2          # the only one holding any
    with pytest.raises(AssertionError):
        furthest_over([0, 0], [1, 1], names)


def test_value_keeps_an_often_hit_long_prefix_over_a_fresh_block() -> None:
    def run(policy: str) -> Calls:
        calls = Calls(policy, 10)
        prompt = chain("system", 6)
        for _ in range(4):
            calls.request("a", prompt)        # hit three times: worth 4 x its cost
        calls.request("b", chain("fresh", 2))  # cached last, never hit
        calls.table.allocate("n", "x", "c", [], 4 * BS)  # 2 free blocks, then 2 evictions
        return calls

    value = run("value")
    assert value.cached_run(chain("system", 6)) == 6 and value.cached_run(chain("fresh", 2)) == 0
    assert value.table.node_stats("n").counters.evictions == {"value": 2}
    lru = run("lru")
    assert lru.cached_run(chain("system", 6)) < 6, "the LRU keeps it too: the comparison proves nothing"


def test_value_ties_go_to_the_block_cached_first_whatever_its_id() -> None:
    table = PageTable("value")
    table.register_node("n", 4, BS, BPB)
    for seq, h in (("x", chain("x", 1)), ("y", chain("y", 1))):
        table.allocate("n", seq, "a", h, BS)
        table.commit([(seq, 0, h[0])])
    table.release(["y"])  # block 1 is cached first, block 0 after it
    table.release(["x"])
    assert table.next_victims("n", 2) == [1, 0]  # the same worth (one block, no hit): cached first
    assert table.allocate("n", "z", "a", [], 4 * BS).block_ids == [2, 3, 1, 0]


def test_value_the_clock_ages_out_a_valuable_block_nobody_hits_again() -> None:
    calls = Calls("value", 8)
    old = chain("old", 2)
    for _ in range(3):
        calls.request("a", old)  # worth 3 x 32 at the first block, clock 0
    for k in range(30):
        calls.request("b", chain(f"fresh-{k}", 3))  # each worth 48 above a clock that rises with every eviction
    assert calls.cached_run(old) == 0
    assert calls.table.node_stats("n").counters.evictions["value"] > 0


@pytest.mark.parametrize("policy", NAMES)
def test_a_restored_policy_evicts_what_the_live_one_does(policy: str, tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False, eviction=policy)
    store.register_node("n", 24, BS, BPB)
    store.configure_tenants([Tenant("a", cache_share_mib=1), Tenant("b", reserved_mib=0.5)])
    for k in range(40):
        request(store, f"s{k}", "ab"[k % 2] if k % 5 else "c", chain(f"p{k % 9}", 1 + k % 4))
    store.sync()
    snapshot = PageTable.from_dict(store.table.to_dict())
    replayed, _ = recover(str(tmp_path), eviction=policy)
    want = store.table.next_victims("n", 24)
    assert snapshot.next_victims("n", 24) == replayed.next_victims("n", 24) == want and len(want) > 8
    big = AllocateRequest("n", "big", "c", [], 20 * BS)
    live = store.allocate_many([big])[0]
    assert snapshot.allocate_many([big]) == replayed.allocate_many([big]) == [live]
    assert snapshot.to_dict() == replayed.to_dict() == store.table.to_dict()
    store.close()


def test_every_policy_is_a_name_block_service_accepts() -> None:
    assert set(NAMES) == {"lru", "value", "fair", "fair+value"} and all(n in POLICIES for n in NAMES)


def test_evictions_are_a_metric_by_tenant_node_and_reason() -> None:
    def evictions(policy: str, tenant: str, reason: str) -> float | None:
        table = flood(policy).table
        r = registry_of(metrics.families(metrics.sample(DurablePageTable(table, None))))
        return r.get_sample_value("kvfleet:block_evictions_total", {"tenant": tenant, "node": "n", "reason": reason})

    assert evictions("fair", "b", "over_share") == 20 and evictions("fair", "a", "over_share") is None
    assert evictions("lru", "a", "lru") == 4 and evictions("lru", "b", "lru") == 16


def test_evictions_reach_kvfleet_blocks_over_the_wire() -> None:
    from kvfleet.block_service.blocks_report import BlocksReport, NodeBlocks, render, to_json
    from kvfleet.block_service.wire import node_stats_from_pb, node_stats_to_pb, tenant_stats_from_pb, tenant_stats_to_pb

    table = flood("fair").table
    node = node_stats_from_pb(node_stats_to_pb(table.node_stats("n")))
    tenants = [tenant_stats_from_pb(tenant_stats_to_pb(t)) for t in table.tenant_stats("n")]
    assert node.counters.evictions == {"over_share": 20}
    report = BlocksReport([NodeBlocks(node)], tenants)
    assert {t["tenant"]: t["evictions"] for t in to_json(report)["tenants"]} == {"a": {}, "b": {"over_share": 20}}
    assert "refused lower  evicted" in render(report)


def test_a_reload_of_the_tenants_file_keeps_what_is_cached() -> None:
    calls = flood("fair")
    before = calls.table.next_victims("n", 16)
    calls.table.configure_tenants([Tenant("b", cache_share_mib=100), Tenant("a")], replace_all=True)
    assert calls.table.node_stats("n").num_cached == 16 and calls.cached_run(chain("a-system", 4)) == 4
    after = calls.table.next_victims("n", 16)  # b's 12 blocks went first, a's 4 (within its share) last;
    assert after == before[12:] + before[:12]  # now a has no share and b one: a's first, each in its own order
