"""Every registered eviction policy, driven through the page table by random operations: the pools'
invariants after every step, and a state rebuilt from the write-ahead log or from a snapshot that
equals the live one and evicts the same blocks next.

Besides the registered policies, ``Cheapest`` runs too: a policy that only the tests register, the
kind the interface is shaped for (it asks for facts and reads tenants' shares), so that the path
the LRU never takes — facts kept per block, a policy state that is not an order, shares told again
on restore — is held to the same invariants.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from block_service.durable import DurablePageTable
from block_service.eviction import POLICIES, CachedFacts, EvictionPolicy
from block_service.node_sync import LiveSequence
from block_service.page_table import PageTable
from block_service.recovery import RecoveryError, recover
from block_service.snapshot import decode_snapshot, encode_snapshot
from kvfleet.allocator import AllocateRequest, Allocation
from kvfleet.errors import FailedPrecondition
from kvfleet.tenants import Tenant

NODES = {"n0": (10, 16), "n1": (7, 32)}  # node -> (num_blocks, block_size): small, evictions are frequent
TENANTS = ["a", "b", "c"]
BPB = 1 << 18  # four blocks per MiB
QUOTAS = [Tenant("a", quota_mib=1.5, reserved_mib=0.25), Tenant("b", quota_mib=2)]  # c: unlimited


def family_hash(family: int, i: int) -> bytes:
    return hashlib.blake2b(f"{family}/{i}".encode(), digest_size=16).digest()


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


def _cached(table: PageTable, node: str) -> int:
    return table.node_stats(node).num_cached


def _victims(table: PageTable) -> dict[str, list[int]]:
    return {n: table.next_victims(n, _cached(table, n)) for n in table.node_ids()}


class EvictionMachine(RuleBasedStateMachine):
    policy = "lru"

    @initialize()
    def setup(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvfleet-eviction-")
        self.store, _ = DurablePageTable.open(self.dir, fsync=False, eviction=self.policy)
        self.table = self.store.table
        assert self.table.eviction == self.policy
        for node, (n, bs) in NODES.items():
            self.store.register_node(node, n, bs, BPB)
        self.store.configure_tenants(QUOTAS)
        self.family: dict[str, int] = {}
        self.granted: set[tuple[str, str]] = set()  # (node, tenant) charged by a sync: may pass its quota
        self.count = 0

    def teardown(self) -> None:
        if hasattr(self, "dir"):
            self._same_after_replay()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _same_after_replay(self) -> PageTable:
        self.store.sync()
        replayed, report = recover(self.dir, eviction=self.policy)
        assert report.stop_reason is None, report.summary()
        assert replayed.to_dict() == self.table.to_dict()
        assert _victims(replayed) == _victims(self.table)
        return replayed

    def _new_seq(self) -> str:
        self.count += 1
        return f"s{self.count}"

    @rule(node=st.sampled_from(sorted(NODES)), tenant=st.sampled_from(TENANTS), family=st.integers(0, 2),
          num_blocks=st.integers(0, 5))
    def allocate(self, node: str, tenant: str, family: int, num_blocks: int) -> None:
        """A prompt of a family: its committed prefix is revived from the cache, the rest taken
        (evicting when the free list runs out)."""
        if node not in self.table.node_ids():
            return
        bs = NODES[node][1]
        seq_id = self._new_seq()
        hashes = [family_hash(family, i) for i in range(num_blocks)]
        result = self.store.allocate_many([AllocateRequest(node, seq_id, tenant, hashes, num_blocks * bs)])[0]
        if isinstance(result, Allocation):
            self.family[seq_id] = family

    @rule(node=st.sampled_from(sorted(NODES)), tenant=st.sampled_from(TENANTS), family=st.integers(0, 2),
          num_blocks=st.integers(1, 4))
    def finished_request(self, node: str, tenant: str, family: int, num_blocks: int) -> None:
        """A whole request: its prompt allocated, committed and released, so that the cache fills."""
        if node in self.table.node_ids():
            self.allocate(node, tenant, family, num_blocks)
            seq_id = f"s{self.count}"
            if seq_id in self.family:
                self.commit_all(seq_id)
                self.store.release([seq_id])
                del self.family[seq_id]

    def commit_all(self, seq_id: str) -> None:
        """The sequence's full blocks from its first held one on, as a node commits a prompt."""
        seq = self.table.sequence(seq_id)
        full = seq.num_tokens // self.table.block_size(seq.node_id)
        commits = [(seq_id, i, family_hash(self.family[seq_id], i)) for i in range(seq.num_dropped, full)]
        try:
            self.store.commit(commits)
        except FailedPrecondition:  # an adopted table shares a block committed with another hash
            pass

    @precondition(lambda self: self.family)
    @rule(data=st.data(), grow=st.integers(1, 40))
    def extend(self, data: st.DataObject, grow: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.family)))
        self.store.extend([(seq_id, self.table.sequence(seq_id).num_tokens + grow)])

    @precondition(lambda self: self.family)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        self.commit_all(data.draw(st.sampled_from(sorted(self.family))))

    @precondition(lambda self: self.family)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(self.family)), min_size=1, max_size=3, unique=True))
        self.store.release(seq_ids)
        for s in seq_ids:
            del self.family[s]

    @precondition(lambda self: self.family)
    @rule(data=st.data())
    def drop_front(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.family)))
        seq = self.table.sequence(seq_id)
        n = data.draw(st.integers(0, seq.num_tokens // self.table.block_size(seq.node_id)))
        assert not self.store.apply(growth=[], commits=[], releases=[], drops=[(seq_id, n)]).errors

    @rule(node=st.sampled_from(sorted(NODES)), data=st.data())
    def sync_node(self, node: str, data: st.DataObject) -> None:
        """The node's own account: its sequences as they are, less some, plus one block_service never
        heard of holding blocks of the node's choice (a cached one is claimed: it leaves the policy)."""
        if node not in self.table.node_ids():
            return
        num_blocks, bs = NODES[node]
        live = [s for s in sorted(self.family) if self.table.sequence(s).node_id == node]
        keep = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        listed = [LiveSequence(s, q.tenant, tuple(q.block_ids), q.num_tokens)
                  for s, q in ((s, self.table.sequence(s)) for s in keep)]
        blocks = data.draw(st.lists(st.integers(0, num_blocks - 1), unique=True, max_size=3))
        tenant = data.draw(st.sampled_from(TENANTS))
        listed.append(LiveSequence(self._new_seq(), tenant, tuple(blocks), len(blocks) * bs))
        result = self.store.sync_node(node, num_blocks, bs, BPB, listed)
        for seq_id in result.released:
            del self.family[seq_id]
        for seq_id in result.adopted:
            self.family[seq_id] = 3  # its own family: what the node wrote is the node's
            self.granted.add((node, tenant))

    @rule(node=st.sampled_from(sorted(NODES)))
    def toggle_node(self, node: str) -> None:
        if node in self.table.node_ids():
            for s in self.store.deregister_node(node):
                del self.family[s]
            self.granted = {g for g in self.granted if g[0] != node}
        else:
            self.store.register_node(node, *NODES[node], BPB)

    @rule(tenant=st.sampled_from(TENANTS[1:]), unlimited=st.booleans())
    def reshare(self, tenant: str, unlimited: bool) -> None:
        """A tenant's share changes (never below what it holds: the quota stays honest)."""
        self.store.configure_tenants([Tenant(tenant, quota_mib=None if unlimited else 4)])

    @rule()
    def restored_and_replayed_evict_alike(self) -> None:
        """A snapshot's table and the log's replay equal the live table, name the same next
        victims, and then evict the same blocks for the same request as the live table."""
        restored = PageTable.from_dict(decode_snapshot(encode_snapshot(7, self.table.to_dict()))[1])
        replayed = self._same_after_replay()
        assert restored.to_dict() == self.table.to_dict() and _victims(restored) == _victims(self.table)
        for node in self.table.node_ids():
            want = min(self.table.num_available(node, "c"), self.table.node_stats(node).num_free + 2)
            if not want:  # (two evictions at most: the cache stays, for the steps after this one)
                continue
            seq_id = self._new_seq()
            req = AllocateRequest(node, seq_id, "c", [], want * NODES[node][1])
            got = [t.allocate_many([req])[0] for t in (restored, replayed)]
            live = self.store.allocate_many([req])[0]
            assert isinstance(live, Allocation) and got == [live, live], "another block was evicted"
            for t in (restored, replayed):
                t.release([seq_id])
            self.store.release([seq_id])
        assert restored.to_dict() == replayed.to_dict() == self.table.to_dict()

    @invariant()
    def invariants_hold(self) -> None:
        if not hasattr(self, "table"):
            return
        self.table.check()  # no block in two states, refcounts, ledgers, the shared index
        for node in self.table.node_ids():
            s = self.table.node_stats(node)
            assert s.num_free + s.num_cached + s.num_used == s.num_blocks
            assert len(set(self.table.next_victims(node, s.num_cached))) == s.num_cached
            for t in self.table.tenant_stats(node):
                if t.blocks_allowed is not None and (node, t.tenant) not in self.granted:
                    assert t.blocks_charged <= t.blocks_allowed, f"{t.tenant} past its quota on {node}"


@pytest.mark.parametrize("policy", sorted(POLICIES) + [Cheapest.name])
def test_every_policy_keeps_the_invariants_and_replays_alike(policy: str) -> None:
    machine = type(f"EvictionMachine_{policy}", (EvictionMachine,), {"policy": policy})
    run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=40, deadline=None))


def test_a_state_written_under_one_policy_is_refused_under_another(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False, eviction=Cheapest.name)
    store.register_node("n0", 8, 16, BPB)
    store.close()
    with pytest.raises(RecoveryError, match="written under the eviction policy 'test-cheapest'.*configured with 'lru'"):
        DurablePageTable.open(str(tmp_path), fsync=False)
    table, _ = recover(str(tmp_path))  # a tool that names no policy reads it under its own
    assert table.eviction == Cheapest.name


def test_an_unknown_policy_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'; known: lru"):
        PageTable("mru")
