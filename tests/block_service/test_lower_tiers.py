"""The per-node lower-tier index: which committed blocks each node keeps in host memory or
on disk, for which tenant; its caps, refused per item; and prefix lookups that see past the hot run.

The state machine runs ``LowerTiers`` (beside a hot ``PrefixIndex``) against a plain dict model under
record / replace / drop, with caps, and compares counts, charges and ``match`` after every step.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.block_service.lower_tiers import LowerTiers
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.prefix_index import PrefixIndex
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, BlockAllocator, TierChange
from kvfleet.core.block_hash import block_hashes
from kvfleet.core.errors import InvalidArgument, NotFound
from kvfleet.core.tenants import MIB, Tenant
from tests.examples import examples


def h(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


# ---- the pure index -------------------------------------------------------------------------------

def test_a_demotion_past_the_cap_is_refused_alone_and_moves_never_charge():
    tiers = LowerTiers()
    out = tiers.apply(0, [TierChange(h(0), "a", TIER_HOST), TierChange(h(1), "a", TIER_HOST),
                          TierChange(h(2), "a", TIER_HOST), TierChange(h(3), "b", TIER_DISK)], {"a": 2})
    assert out.refused == [h(2)] and out.refused_tenants == ["a"]
    assert [c.block_hash for c in out.applied] == [h(0), h(1), h(3)]
    assert tiers.charged(0) == {"a": 2, "b": 1}
    assert tiers.counts(0) == {TIER_HOST: 2, TIER_DISK: 1}
    # host → disk of a block already charged: not a new charge, so not refused at the cap
    out = tiers.apply(0, [TierChange(h(0), "a", TIER_DISK)], {"a": 2})
    assert out.refused == [] and tiers.counts(0) == {TIER_HOST: 1, TIER_DISK: 2}
    # promoted: uncharged, so the next demotion fits again
    out = tiers.apply(0, [TierChange(h(1), "a", TIER_NONE), TierChange(h(2), "a", TIER_HOST)], {"a": 2})
    assert out.refused == [] and tiers.charged(0) == {"a": 2, "b": 1}
    tiers.check({0})


def test_a_refused_block_another_tenant_held_is_forgotten_as_the_node_drops_it():
    tiers = LowerTiers()
    tiers.apply(3, [TierChange(h(0), "b", TIER_HOST)], {})
    out = tiers.apply(3, [TierChange(h(0), "a", TIER_HOST)], {"a": 0})
    assert out.refused == [h(0)]
    assert tiers.node(3) is None and tiers.charged(3) == {}
    tiers.check({3})


def test_replace_and_drop():
    tiers = LowerTiers()
    tiers.apply(1, [TierChange(h(i), "a", TIER_HOST) for i in range(3)], {})
    held = [TierChange(h(2), "a", TIER_DISK), TierChange(h(7), "b", TIER_HOST)]
    assert tiers.replace(1, held) is True
    assert sorted(tiers.node(1).changes(), key=lambda c: c.block_hash) == sorted(held, key=lambda c: c.block_hash)
    assert tiers.replace(1, list(reversed(held))) is False  # the same account: nothing changed
    tiers.drop(1)
    assert len(tiers) == 0 and tiers.counts(1) == {TIER_HOST: 0, TIER_DISK: 0}
    tiers.check(set())


def test_match_counts_the_blocks_past_the_hot_run_held_in_any_tier():
    hot, tiers = PrefixIndex(), LowerTiers()
    for i in range(2):
        hot.add(h(i), 0, i)          # node 0: blocks 0, 1 hot
    tiers.apply(0, [TierChange(h(2), "a", TIER_HOST), TierChange(h(3), "a", TIER_DISK)], {})
    hot.add(h(4), 0, 9)              # hot again after the lower-tier ones
    tiers.apply(1, [TierChange(h(0), "a", TIER_HOST)], {})  # node 1: only the first, cold
    tiers.apply(2, [TierChange(h(1), "a", TIER_HOST)], {})  # node 2: not from the start: nothing
    prompt = [h(i) for i in range(7)]
    depth = hot.match(prompt)
    assert depth == {0: 2}
    assert tiers.match(prompt, hot, depth) == {0: 3, 1: 1}
    assert tiers.match(prompt, hot, depth, among=1 << 1) == {1: 1}
    assert tiers.match(prompt, hot, depth, among=1 << 5) == {}
    assert LowerTiers().match(prompt, hot, depth) == {}


def test_invalid_changes_say_why():
    table = PageTable()
    table.register_node("n", 4, 16, MIB)
    with pytest.raises(InvalidArgument, match="tier must be one of"):
        table.record_tiers("n", [TierChange(h(0), "a", "gpu")])
    with pytest.raises(InvalidArgument, match="16 bytes"):
        table.record_tiers("n", [TierChange(b"short", "a", TIER_HOST)])
    with pytest.raises(InvalidArgument, match="tier must be one of"):
        table.replace_tiers("n", [TierChange(h(0), "a", TIER_NONE)])
    with pytest.raises(NotFound):
        table.record_tiers("other", [TierChange(h(0), "a", TIER_HOST)])
    assert table.lower_tiers("n") == []


# ---- through the page table and the in-process allocator ------------------------------------------

def test_local_allocator_caps_counts_and_lookups():
    alloc: BlockAllocator = LocalBlockAllocator.standalone(num_blocks=4, block_size=16, bytes_per_block=MIB)
    table = alloc.page_table
    table.configure_tenants([Tenant("t", quota_mib=1, lower_tier_quota_mib=2)])
    hs = block_hashes(list(range(96)), 16, extra=b"t")
    a = alloc.allocate("r1", "t", hs, 16)             # the hot quota is 1 block: tiers do not count
    assert a.block_ids == [0]
    alloc.commit([("r1", 0, hs[0])])
    alloc.record_tiers([TierChange(hs[i], "t", TIER_HOST) for i in (1, 2, 3)])
    assert alloc.take_tier_refusals() == [hs[3]]
    assert alloc.take_tier_refusals() == []
    assert table.match_tiers(hs) == ({"local": 1}, {"local": 2})
    assert table.match_prefix(hs) == {"local": 1}    # the hot answer is unchanged
    (ts,) = [t for t in table.tenant_stats("local") if t.tenant == "t"]
    assert (ts.blocks_charged, ts.lower_tier_blocks, ts.lower_tier_allowed) == (1, 2, 2)
    assert ts.counters.refusals_lower_tier == 1
    assert table.node_stats("local").lower_tier == {TIER_HOST: 2, TIER_DISK: 0}
    alloc.set_tier_source(lambda: [])                  # in process: nothing to re-send, nothing replaced
    assert len(table.lower_tiers("local")) == 2
    restored = PageTable.from_dict(table.to_dict())    # snapshot round trip
    restored.check()
    assert restored.match_tiers(hs) == table.match_tiers(hs)
    assert restored.tenant_stats("local") != [] and restored.lower_tiers("local") == table.lower_tiers("local")
    table.deregister_node("local")                     # dropped with the node
    table.register_node("local", 4, 16, MIB)
    assert table.lower_tiers("local") == [] and table.match_tiers(hs) == ({"local": 0}, {})
    table.check()


def test_a_sync_with_another_shape_drops_the_old_tiers():
    table = PageTable()
    table.register_node("n", 4, 16, MIB)
    table.record_tiers("n", [TierChange(h(0), "a", TIER_HOST)])
    table.sync_node("n", 8, 16, MIB, [])
    assert table.lower_tiers("n") == []
    table.check()


# ---- the index against a model --------------------------------------------------------------------

SLOTS, HASHES, TENANTS = 3, 8, ("a", "b")
CAPS = {"a": 3}
change = st.builds(TierChange, st.sampled_from([h(i) for i in range(HASHES)]), st.sampled_from(TENANTS),
                   st.sampled_from([TIER_HOST, TIER_DISK, TIER_NONE]))


class TiersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tiers, self.hot = LowerTiers(), PrefixIndex()
        self.model: dict[int, dict[bytes, tuple[str, str]]] = {s: {} for s in range(SLOTS)}
        self.hot_model: dict[int, set[bytes]] = {s: set() for s in range(SLOTS)}

    @rule(slot=st.integers(0, SLOTS - 1), changes=st.lists(change, max_size=6))
    def record(self, slot, changes):
        out = self.tiers.apply(slot, changes, CAPS)
        held, refused = self.model[slot], []
        for c in changes:
            old = held.get(c.block_hash)
            if c.tier == TIER_NONE:
                held.pop(c.block_hash, None)
                continue
            charged = sum(1 for _, t in held.values() if t == c.tenant)
            if (old is None or old[1] != c.tenant) and c.tenant in CAPS and charged + 1 > CAPS[c.tenant]:
                held.pop(c.block_hash, None)
                refused.append(c.block_hash)
                continue
            held[c.block_hash] = (c.tier, c.tenant)
        assert out.refused == refused

    @rule(slot=st.integers(0, SLOTS - 1),
          held=st.lists(change.filter(lambda c: c.tier != TIER_NONE), max_size=6))
    def replace(self, slot, held):
        fresh = {c.block_hash: (c.tier, c.tenant) for c in held}
        assert self.tiers.replace(slot, held) == (fresh != self.model[slot])
        self.model[slot] = fresh

    @rule(slot=st.integers(0, SLOTS - 1))
    def drop(self, slot):
        self.tiers.drop(slot)
        self.model[slot] = {}

    @rule(slot=st.integers(0, SLOTS - 1), i=st.integers(0, HASHES - 1))
    def commit_hot(self, slot, i):
        self.hot.add(h(i), slot, i)
        self.hot_model[slot].add(h(i))

    @invariant()
    def agrees(self):
        self.tiers.check(set(range(SLOTS)))
        for slot, held in self.model.items():
            assert self.tiers.counts(slot) == {t: sum(1 for v, _ in held.values() if v == t) for t in (TIER_HOST, TIER_DISK)}
            charged: dict[str, int] = {}
            for _, t in held.values():
                charged[t] = charged.get(t, 0) + 1
            assert self.tiers.charged(slot) == charged
        for start in range(3):
            prompt = [h(i) for i in range(start, HASHES)]
            depth = self.hot.match(prompt)
            want = {}
            for slot in range(SLOTS):
                run = 0
                while run < len(prompt) and (prompt[run] in self.model[slot] or prompt[run] in self.hot_model[slot]):
                    run += 1
                if run > depth.get(slot, 0):
                    want[slot] = run - depth.get(slot, 0)
            assert self.tiers.match(prompt, self.hot, depth) == want


TestTiersMachine = TiersMachine.TestCase
TestTiersMachine.settings = settings(max_examples=examples(60), stateful_step_count=30, deadline=None)
