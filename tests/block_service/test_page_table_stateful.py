"""Random operation sequences over several nodes and tenants (node syncs included): invariants 1-3
after every step, refusals and rejected calls change nothing, and replaying the log rebuilds the
same state."""

from __future__ import annotations

import hashlib
import shutil
import tempfile

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.node_sync import LiveSequence
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import recover
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal
from kvfleet.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvfleet.core.tenants import Tenant
from tests.examples import examples

NODES = {"n0": (12, 16), "n1": (8, 32)}  # node -> (num_blocks, block_size)
TENANTS = ["a", "b", "c"]
BPB = 1 << 18  # four blocks per MiB


def family_hash(family: int, i: int) -> bytes:
    """Same family, same index: same content, so sequences of a family share their prefix."""
    return hashlib.blake2b(f"{family}/{i}".encode(), digest_size=16).digest()


class PageTableMachine(RuleBasedStateMachine):
    eviction = "lru"  # the pools' eviction policy (``test_eviction_stateful`` runs every one)

    @initialize()
    def setup(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvfleet-stateful-")
        self.store, _ = DurablePageTable.open(self.dir, fsync=False, eviction=self.eviction)
        self.table = self.store.table
        for node, (n, bs) in NODES.items():
            self.store.register_node(node, n, bs, BPB)
        self.store.configure_tenants([Tenant("a", quota_mib=1.5, reserved_mib=0.5),
                                      Tenant("b", quota_mib=2)])
        self.family: dict[str, int] = {}
        self.count = 0

    def teardown(self) -> None:
        if hasattr(self, "dir"):
            self.replayed()
            shutil.rmtree(self.dir, ignore_errors=True)

    def replayed(self) -> PageTable:
        """The table the log rebuilds, checked equal to the live one."""
        self.store.sync()
        replayed, report = recover(self.dir, eviction=self.eviction)
        assert report.stop_reason is None, report.summary()
        assert replayed.to_dict() == self.table.to_dict()
        return replayed

    def _unchanged_on_refusal(self, call, is_refusal) -> object:
        before = self.table.to_dict()
        result = call()
        if is_refusal(result):
            assert self.table.to_dict() == before
        return result

    @rule(node=st.sampled_from(sorted(NODES)), tenant=st.sampled_from(TENANTS), family=st.integers(0, 2),
          num_hashes=st.integers(0, 4), num_tokens=st.integers(0, 200))
    def allocate(self, node: str, tenant: str, family: int, num_hashes: int, num_tokens: int) -> None:
        if node not in self.table.node_ids():
            return
        self.count += 1
        seq_id = f"s{self.count}"
        hashes = [family_hash(family, i) for i in range(num_hashes)]
        req = AllocateRequest(node, seq_id, tenant, hashes, num_tokens)
        result = self._unchanged_on_refusal(lambda: self.store.allocate_many([req])[0],
                                            lambda r: isinstance(r, Refusal))
        if isinstance(result, Allocation):
            self.family[seq_id] = family

    @precondition(lambda self: self.family)
    @rule(data=st.data(), grow=st.integers(0, 70))
    def extend(self, data: st.DataObject, grow: int) -> None:
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(self.family)), min_size=1, max_size=3, unique=True))
        growth = [(s, self.table.sequence(s).num_tokens + grow) for s in seq_ids]
        self._unchanged_on_refusal(lambda: self.store.extend(growth),
                                   lambda r: all(isinstance(x, Refusal) for x in r))

    @precondition(lambda self: self.family)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.family)))
        seq = self.table.sequence(seq_id)
        full = seq.num_tokens // self.table.block_size(seq.node_id)
        if full:
            i = data.draw(st.integers(0, full - 1))
            before = self.table.to_dict()
            try:
                self.store.commit([(seq_id, i, family_hash(self.family[seq_id], i))])
            except FailedPrecondition:  # an adopted table shares a block committed with another hash
                assert self.table.to_dict() == before

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
        """A sliding-window sequence gives back its leading full blocks (through ApplyMany, logged)."""
        seq_id = data.draw(st.sampled_from(sorted(self.family)))
        seq = self.table.sequence(seq_id)
        n = data.draw(st.integers(0, seq.num_tokens // self.table.block_size(seq.node_id)))
        result = self.store.apply(growth=[], commits=[], releases=[], drops=[(seq_id, n)])
        assert not result.errors
        assert self.table.sequence(seq_id).num_dropped == max(n, seq.num_dropped)

    @rule(node=st.sampled_from(sorted(NODES)))
    def toggle_node(self, node: str) -> None:
        if node in self.table.node_ids():
            for s in self.store.deregister_node(node):
                del self.family[s]
        else:
            self.store.register_node(node, *NODES[node], BPB)

    @rule(node=st.sampled_from(sorted(NODES)), data=st.data(), bigger=st.booleans())
    def sync_node(self, node: str, data: st.DataObject, bigger: bool) -> None:
        """The node's own account: some of its sequences gone, some grown by a block block_service
        never heard of, some new (valid or not); and now and then a pool of another shape."""
        num_blocks, bs = NODES[node]
        if bigger and data.draw(st.integers(0, 4)) == 0:
            num_blocks *= 2
        same_shape = node in self.table.node_ids() and self.table.node_stats(node).num_blocks == num_blocks
        live = [s for s in sorted(self.family) if self.table.sequence(s).node_id == node]
        keep = data.draw(st.lists(st.sampled_from(live), unique=True)) if live else []
        listed = []
        for seq_id in keep:
            seq = self.table.sequence(seq_id)
            table, n = tuple(seq.block_ids), seq.num_tokens
            if data.draw(st.booleans()):
                table += (data.draw(st.integers(0, num_blocks - 1).filter(lambda b: b not in table)),)
                n = (len(table) - 1) * bs + 1
            listed.append(LiveSequence(seq_id, seq.tenant, table, n))
        for _ in range(data.draw(st.integers(0, 2))):
            self.count += 1
            table = tuple(data.draw(st.lists(st.integers(0, num_blocks), max_size=3)))  # maybe invalid
            n = data.draw(st.sampled_from([len(table) * bs, max(0, len(table) - 1) * bs + 1, 5]))
            listed.append(LiveSequence(f"s{self.count}", data.draw(st.sampled_from(TENANTS)), table, n))
        result = self.store.sync_node(node, num_blocks, bs, BPB, listed)
        if same_shape:
            assert set(result.released) == set(live) - set(keep)
            assert not {s for s, _ in result.refused} & set(keep)
        for seq_id in result.released:
            del self.family[seq_id]
        for seq_id in result.adopted:
            self.family[seq_id] = 3  # its own family: what the node wrote is the node's
        for s in listed:
            if s.seq_id in result.adopted or s.seq_id in result.updated:
                got = self.table.sequence(s.seq_id)
                assert (tuple(got.block_ids), got.num_tokens, got.tenant) == (s.block_ids, s.num_tokens, s.tenant)

    @rule(tenant=st.sampled_from(TENANTS[:2]), quota=st.sampled_from([0.25, 1, 3, None]))
    def configure(self, tenant: str, quota: float | None) -> None:
        self.store.configure_tenants([Tenant(tenant, quota_mib=quota)])

    @rule(data=st.data(), family=st.integers(0, 2),
          bad=st.sampled_from(["dup", "short", "no node", "unknown", "shrink", "past its blocks"]))
    def bad_calls_are_rejected_and_change_nothing(self, data: st.DataObject, family: int, bad: str) -> None:
        """Each bad call raises its own error, with its own words, and leaves state and log as they were."""
        nodes = sorted(self.table.node_ids())
        node = nodes[0] if nodes else "n0"
        if bad in ("dup", "short") and not nodes:
            bad = "no node"
        if bad in ("shrink", "past its blocks"):
            grown = [s for s in sorted(self.family) if self.table.sequence(s).num_tokens % 16]
            if not grown:
                bad = "unknown"
            else:
                seq = self.table.sequence(data.draw(st.sampled_from(grown)))
        h = family_hash(family, 0)
        calls = {
            "dup": (lambda: self.store.allocate_many([AllocateRequest(node, "x", "a", [h, h], 40)]),
                    InvalidArgument, "block hashes repeat"),
            "short": (lambda: self.store.allocate_many([AllocateRequest(node, "x", "a", [b"x"], 40)]),
                      InvalidArgument, "a block hash must be 16 bytes"),
            "no node": (lambda: self.store.allocate_many([AllocateRequest("nX", "x", "a", [], 40)]),
                        NotFound, "unknown node 'nX'"),
            "unknown": (lambda: self.store.release(["nope"]), NotFound, "unknown sequence 'nope'"),
            "shrink": (lambda: self.store.extend([(seq.seq_id, seq.num_tokens - 1)]),
                       InvalidArgument, "extend cannot shrink"),
            "past its blocks": (lambda: self.store.commit([(seq.seq_id, len(seq.block_ids), h)]),
                                InvalidArgument, "is not one of them"),
        }
        call, error, words = calls[bad]
        before, lsn = self.table.to_dict(), self.store.lsn
        with pytest.raises(error, match=words):
            call()
        assert self.table.to_dict() == before and self.store.lsn == lsn

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "table"):
            self.table.check()
            for node in self.table.node_ids():
                s = self.table.node_stats(node)
                assert s.num_free + s.num_cached + s.num_used == s.num_blocks


PageTableMachine.TestCase.settings = settings(max_examples=examples(100), stateful_step_count=50, deadline=None)
TestPageTableMachine = PageTableMachine.TestCase
