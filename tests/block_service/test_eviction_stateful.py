"""Every registered eviction policy, driven through the page table by random operations: the pools'
invariants after every step (free + cached + used = the pool, no block in two states, reference
counts = the tables holding them, no tenant charged past its quota and grace: ``PageTable.check``),
and a state rebuilt from the write-ahead log or from a snapshot that equals the live one and evicts
the same blocks next.

The machine also changes tenants' shares of the cached blocks (``cache_share_mib``, a share past
the pool included), which the fair policies read. Besides the registered policies (``lru``,
``value``, ``fair``, ``fair+value``), ``Cheapest`` runs too: a policy that only the tests register, the
kind the interface is shaped for (it asks for facts and reads tenants' shares), so that the path
the LRU never takes — facts kept per block, a policy state that is not an order, shares told again
on restore — is held to the same invariants.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.eviction import POLICIES, CachedFacts, EvictionPolicy
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import RecoveryError, recover
from kvfleet.block_service.snapshot import decode_snapshot, encode_snapshot
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.tenants import Tenant
from tests.block_service.test_page_table_stateful import BPB, NODES, TENANTS, PageTableMachine, family_hash
from tests.examples import examples


class Cheapest(EvictionPolicy):
    """Evicts first the blocks of tenants without a share, then the cheapest to recompute, the
    least hit, the oldest; the block id breaks ties. Checks the facts it is handed as it goes."""

    __slots__ = ("num_blocks", "keys", "shares", "tick")
    name = "test-cheapest"
    needs_facts = True
    state_keys = ("cheapest",)

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.keys: dict[int, tuple[str, int, int, int]] = {}  # block -> (tenant, cost, hits, tick)
        self.shares: dict[str, int] = {}
        self.tick = 0

    @classmethod
    def empty(cls, num_blocks: int) -> Cheapest:
        return cls(num_blocks)

    def cached(self, blocks: list[int], facts: CachedFacts | None) -> None:
        assert facts is not None and facts.tick > self.tick, "facts missing, or the tick went back"
        assert len(facts.tenants) == len(facts.hits) == len(facts.costs) == len(blocks)
        assert all(c > 0 and c % 16 == 0 for c in facts.costs) and all(h >= 0 for h in facts.hits)
        self.tick = facts.tick
        for b, t, cost, hits in zip(blocks, facts.tenants, facts.costs, facts.hits):
            assert b not in self.keys
            self.keys[b] = (t, cost, hits, facts.tick)

    def _order(self, b: int) -> tuple:
        t, cost, hits, tick = self.keys[b]
        return (t in self.shares, cost, hits, tick, b)

    def revived(self, blocks: list[int]) -> None:
        for b in blocks:
            del self.keys[b]

    def discard(self, block: int) -> None:
        del self.keys[block]

    def evict(self) -> int:
        b = min(self.keys, key=self._order)
        del self.keys[b]
        return b

    def victims(self, n: int) -> list[int]:
        return sorted(self.keys, key=self._order)[:n]

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, block: int) -> bool:
        return block in self.keys

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.keys))

    def set_shares(self, shares: Mapping[str, int]) -> None:
        self.shares = dict(shares)

    def to_state(self) -> dict[str, bytes]:
        rows = sorted((b, cost, hits, tick) for b, (_, cost, hits, tick) in self.keys.items())
        tenants = "\n".join(self.keys[r[0]][0] for r in rows)
        return {"cheapest": np.array(rows, dtype="<i8").reshape(-1, 4).tobytes() + b"|" + tenants.encode()
                            + b"|" + str(self.tick).encode()}

    @classmethod
    def from_state(cls, num_blocks: int, state: Mapping[str, bytes]) -> Cheapest:
        policy = cls(num_blocks)
        raw, tenants, tick = bytes(state["cheapest"]).rsplit(b"|", 2)
        rows = np.frombuffer(raw, dtype="<i8").reshape(-1, 4).tolist()
        for (b, cost, hits, t_tick), t in zip(rows, tenants.decode().split("\n") if rows else []):
            policy.keys[b] = (t, cost, hits, t_tick)
        policy.tick = int(tick)
        return policy


@pytest.fixture(scope="module", autouse=True)
def cheapest_registered() -> Iterator[None]:
    POLICIES[Cheapest.name] = Cheapest
    yield
    del POLICIES[Cheapest.name]


def _victims(table: PageTable) -> dict[str, list[int]]:
    """Per node, every cached block in the order the policy would evict it."""
    return {n: table.next_victims(n, table.node_stats(n).num_cached) for n in table.node_ids()}


class EvictionMachine(PageTableMachine):
    """The page table's machine (allocations, growth, commits, releases, drops, syncs, nodes coming
    and going, tenants reconfigured, bad calls; invariants 1-3 after every step, the log replayed at
    the end), under ``eviction``, with requests that fill the cache and a rule that restores and
    replays the table mid-run and then evicts from all three alike."""

    @rule(node=st.sampled_from(sorted(NODES)), tenant=st.sampled_from(TENANTS), family=st.integers(0, 2),
          num_blocks=st.integers(1, 4))
    def finished_request(self, node: str, tenant: str, family: int, num_blocks: int) -> None:
        """A whole request: its prompt allocated (its committed prefix revived from the cache),
        committed and released, so that the cache fills and evictions follow."""
        if node not in self.table.node_ids():
            return
        self.count += 1
        seq_id, bs = f"s{self.count}", NODES[node][1]
        hashes = [family_hash(family, i) for i in range(num_blocks)]
        if isinstance(self.store.allocate_many([AllocateRequest(node, seq_id, tenant, hashes, num_blocks * bs)])[0],
                      Allocation):
            self.store.commit([(seq_id, i, h) for i, h in enumerate(hashes)])
            self.store.release([seq_id])

    @rule(tenant=st.sampled_from(TENANTS), quota=st.sampled_from([1, 3, None]),
          share=st.sampled_from([None, 0, 0.5, 1, 2.5, 40]))
    def share(self, tenant: str, quota: float | None, share: float | None) -> None:
        """A tenant's share of the cached blocks (``cache_share_mib``: four blocks per MiB here;
        None: its reserve, none), told to the policy again; a share past the pool included. ``c``
        stays unlimited: the restore rule's probe allocates as ``c``."""
        quota = None if tenant == "c" else quota
        self.store.configure_tenants([Tenant(tenant, quota_mib=quota, cache_share_mib=share)])

    @rule()
    def restored_and_replayed_evict_alike(self) -> None:
        """A snapshot's table and the log's replay equal the live table, name the same next
        victims, and then evict the same blocks for the same request as the live table."""
        restored = PageTable.from_dict(decode_snapshot(encode_snapshot(7, self.table.to_dict()))[1])
        replayed = self.replayed()
        assert restored.to_dict() == self.table.to_dict()
        assert _victims(restored) == _victims(replayed) == _victims(self.table)
        for node in self.table.node_ids():
            want = min(self.table.num_available(node, "c"), self.table.node_stats(node).num_free + 2)
            if not want:  # (two evictions at most: the cache stays, for the steps after this one)
                continue
            self.count += 1
            req = AllocateRequest(node, f"s{self.count}", "c", [], want * NODES[node][1])
            got = [t.allocate_many([req])[0] for t in (restored, replayed)]
            live = self.store.allocate_many([req])[0]
            assert isinstance(live, Allocation) and got == [live, live], "another block was evicted"
            for t in (restored, replayed):
                t.release([req.seq_id])
            self.store.release([req.seq_id])
        assert restored.to_dict() == replayed.to_dict() == self.table.to_dict()

    @invariant()
    def victims_are_the_cached_blocks(self) -> None:
        if hasattr(self, "table"):
            for node, victims in _victims(self.table).items():
                assert len(set(victims)) == len(victims) == self.table.node_stats(node).num_cached


@pytest.mark.parametrize("policy", sorted(POLICIES) + [Cheapest.name])
def test_every_policy_keeps_the_invariants_and_replays_alike(policy: str) -> None:
    machine = type(f"EvictionMachine_{policy}", (EvictionMachine,), {"eviction": policy})
    run_state_machine_as_test(machine, settings=settings(max_examples=examples(60), stateful_step_count=50, deadline=None))


def test_a_state_written_under_one_policy_is_refused_under_another(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False, eviction=Cheapest.name)
    store.register_node("n0", 8, 16, BPB)
    store.close()
    with pytest.raises(RecoveryError, match="written under the eviction policy 'test-cheapest'.*configured with 'lru'"):
        DurablePageTable.open(str(tmp_path), fsync=False, eviction="lru")
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)  # none named (auto): the state's own
    assert store.table.eviction == Cheapest.name
    store.close()
    table, _ = recover(str(tmp_path))  # a tool that names no policy reads it under its own
    assert table.eviction == Cheapest.name


def test_an_unknown_policy_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown eviction policy 'mru'; known: fair, fair\+value, lru, .*value"):
        PageTable("mru")
