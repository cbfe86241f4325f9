"""Pins under every eviction policy, driven through the page table by random operations: the
eviction machine's steps (requests filling the cache, syncs, nodes coming and going, tenants
reconfigured, the table restored from a snapshot and replayed from the log mid-run, evicting alike)
plus pins, budgets changing under them, the clock moving and the leader expiring pins, and floods
that take every evictable block of a node. Invariants: a pinned hash's cached block is never chosen
for eviction (held out of the policy's reach, never among its next victims, still there after a
flood), the held blocks are exactly the cached pinned ones, a tenant's new pins never pass its
budget, and the log and a snapshot rebuild the same pins and the same held blocks (the machine's
restore/replay rule and its teardown).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from kvfleet.block_service.eviction import POLICIES
from kvfleet.block_service.eviction.pinned import PinnedPolicy
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.errors import FailedPrecondition, ResourceExhausted
from kvfleet.core.tenants import Tenant
from tests.block_service.test_eviction_stateful import EvictionMachine, _victims
from tests.block_service.test_page_table_stateful import BPB, NODES, TENANTS, family_hash
from tests.examples import examples


def _pinned_present(table) -> dict[str, set[bytes]]:
    """Per node, the pinned hashes whose block the node holds (cached or in use)."""
    out: dict[str, set[bytes]] = {}
    for node_id, node in table._fleet.nodes.items():
        if node.pins is not None:
            pool = node.pool
            out[node_id] = {h for h in node.pins.pins if pool._index.block(h, pool.slot) is not None}
    return out


class PinMachine(EvictionMachine):
    clock = 1_000

    @rule(tenant=st.sampled_from(TENANTS), pinned_mib=st.sampled_from([0, 0.5, 1, 2]))
    def budget(self, tenant: str, pinned_mib: float) -> None:
        """A tenant's pin budget set (four blocks per MiB here), lowered to nothing included: its
        pins stay until they expire. ``c`` stays unlimited (the restore rule allocates as ``c``)."""
        quota = None if tenant == "c" else 3
        self.store.configure_tenants([Tenant(tenant, quota_mib=quota, pinned_mib=pinned_mib)])

    @rule(node=st.sampled_from(sorted(NODES)), tenant=st.sampled_from(TENANTS), family=st.integers(0, 2),
          num_blocks=st.integers(1, 4), ttl=st.integers(1, 60))
    def pin(self, node: str, tenant: str, family: int, num_blocks: int, ttl: int) -> None:
        """A prompt's leading blocks pinned: refused whole past the budget, changing nothing; a
        re-pin refreshes the expiry without charging."""
        if node not in self.table.node_ids():
            return
        hashes = [family_hash(family, i) for i in range(num_blocks)]
        pins = self.table._fleet.nodes[node].pins
        before_pins = dict(pins.pins) if pins is not None else {}
        had = pins.counts.get(tenant, 0) if pins is not None else 0
        before, lsn = self.table.to_dict(), self.store.lsn
        try:
            got = self.store.pin_prefix(node, tenant, hashes, self.clock + ttl)
        except (ResourceExhausted, FailedPrecondition) as err:
            assert self.table.to_dict() == before and self.store.lsn == lsn
            assert ("may pin" in str(err)) == isinstance(err, ResourceExhausted)
            return
        new = [h for h in hashes if h not in before_pins]
        assert got.num_new == len(new) and got.tenant_pinned == had + len(new)
        assert not new or got.tenant_pinned <= got.allowed, "a new pin passed the budget"
        pins = self.table._fleet.nodes[node].pins
        for h in hashes:
            if before_pins.get(h) is None or before_pins[h].tenant == tenant:
                assert pins.pins[h].expires_at == self.clock + ttl

    @rule(dt=st.integers(0, 40))
    def time_passes(self, dt: int) -> None:
        """The leader's clock moves and it ends the pins due (a logged record per node)."""
        self.clock += dt
        self.store.expire_pins(self.clock)
        assert not self.table.pins.due(self.clock)

    @rule(node=st.sampled_from(sorted(NODES)))
    def flood(self, node: str) -> None:
        """Another tenant takes every block it may on the node: every cached pinned block stays."""
        if node not in self.table.node_ids():
            return
        present = _pinned_present(self.table).get(node, set())
        want = self.table.num_available(node, "c")
        if not want:
            return
        self.count += 1
        seq_id = f"s{self.count}"
        got = self.store.allocate_many([AllocateRequest(node, seq_id, "c", [], want * NODES[node][1])])[0]
        assert isinstance(got, Allocation)
        assert _pinned_present(self.table).get(node, set()) == present, "a pinned block was evicted"
        self.store.release([seq_id])

    @invariant()
    def victims_are_the_cached_blocks(self) -> None:
        """The policy's next victims are the cached blocks that no pin holds, and only those."""
        if not hasattr(self, "table"):
            return
        victims = _victims(self.table)
        for node_id, node in self.table._fleet.nodes.items():
            policy = node.pool._policy
            held = policy.held if isinstance(policy, PinnedPolicy) else set()
            assert len(set(victims[node_id])) == len(victims[node_id]) == node.pool.num_cached - len(held)
            assert held.isdisjoint(victims[node_id]), "a pinned block is among the next victims"


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_pinned_blocks_are_never_evicted_and_replay_alike(policy: str) -> None:
    machine = type(f"PinMachine_{policy}", (PinMachine,), {"eviction": policy})
    run_state_machine_as_test(machine, settings=settings(max_examples=examples(40), stateful_step_count=50,
                                                         deadline=None))


def test_bpb_gives_four_blocks_per_mib() -> None:
    """(The budgets above read in blocks: 0.5 MiB is two blocks of this machine's nodes.)"""
    assert Tenant("a", pinned_mib=0.5).pinned_blocks(BPB) == 2
