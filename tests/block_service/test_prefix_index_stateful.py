"""The fleet-wide prefix index against the scan it replaced.

``match_prefix`` used to walk each node's own hash → block dict; it now asks one index shared by all
nodes. This machine drives a page table through commits, evictions (small pools), releases,
drop_front, node removal, re-registration, node syncs (which release and claim blocks) and snapshot
round trips, and keeps beside it ``OldScan``: a tiny model of the per-node dicts as the old
``BlockPool`` kept them, fed only with what the page table's public calls answer. After every step,
``match_prefix`` of every probe prompt must equal the old scan over the model, for all nodes and for
each node alone.
"""

from __future__ import annotations

import hashlib

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfleet.block_service.node_sync import LiveSequence
from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import DROPPED, AllocateRequest, Allocation
from kvfleet.core.errors import FailedPrecondition
from tests.examples import examples

NODES = {"n0": 8, "n1": 10, "n2": 12, "n3": 9}  # node -> num_blocks (small: evictions are frequent)
BS, BPB = 16, 1 << 18
FAMILIES = 2


def family_hash(family: int, i: int) -> bytes:
    return hashlib.blake2b(f"{family}/{i}".encode(), digest_size=16).digest()


PROBES = [[family_hash(f, i) for i in range(n)] for f in range(FAMILIES) for n in (1, 3, 6)] + [
    [family_hash(0, 0), family_hash(1, 1), family_hash(0, 2)],  # a prefix that stops matching early
    [family_hash(2, 5), family_hash(2, 6)],                     # no node's prefix starts there
]


class OldScan:
    """Per node, the old pool's hash → block dict, rebuilt from the calls' answers: a commit names a
    block (the first block of a node with a hash keeps it), a block taken fresh from the cache is
    evicted, a block no table holds stays cached if it is the one named, else it is freed, a block
    a sync claims loses its hash."""

    def __init__(self) -> None:
        self.index: dict[str, dict[bytes, int]] = {}
        self.hashes: dict[str, dict[int, bytes]] = {}  # every block with a hash, named or not

    def add_node(self, node: str) -> None:
        self.index[node], self.hashes[node] = {}, {}

    def forget(self, node: str, block: int) -> None:
        h = self.hashes[node].pop(block, None)
        if h is not None and self.index[node].get(h) == block:
            del self.index[node][h]

    def commit(self, node: str, block: int, h: bytes) -> None:
        if self.hashes[node].get(block) != h:
            self.hashes[node][block] = h
            self.index[node].setdefault(h, block)

    def unreferenced(self, node: str, block: int) -> None:
        h = self.hashes[node].get(block)
        if h is None or self.index[node].get(h) != block:
            self.hashes[node].pop(block, None)  # freed

    def scan(self, hashes: list[bytes], node: str) -> int:
        n = 0
        for h in hashes:
            if h not in self.index[node]:
                break
            n += 1
        return n


class PrefixIndexMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.table = PageTable()
        self.old = OldScan()
        for node in NODES:
            self._register(node)
        self.live: dict[str, int] = {}  # seq_id -> family
        self.count = 0

    def _register(self, node: str) -> None:
        self.table.register_node(node, NODES[node], BS, BPB)
        self.old.add_node(node)

    def _refs(self, node: str) -> dict[int, int]:
        refs: dict[int, int] = {}
        for s in self.live:
            seq = self.table.sequence(s)
            if seq.node_id == node:
                for b in seq.held:
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def _fresh(self, node: str, blocks: list[int]) -> None:
        for b in blocks:  # free, or evicted from the cache
            self.old.forget(node, b)

    def _unreferenced(self, node: str, blocks: list[int]) -> None:
        refs = self._refs(node)
        for b in blocks:
            if not refs.get(b):
                self.old.unreferenced(node, b)

    @rule(node=st.sampled_from(sorted(NODES)), family=st.integers(0, FAMILIES - 1), num_blocks=st.integers(1, 6))
    def allocate(self, node: str, family: int, num_blocks: int) -> None:
        if node not in self.table.node_ids():
            return
        self.count += 1
        seq_id = f"s{self.count}"
        hashes = [family_hash(family, i) for i in range(num_blocks)]
        result = self.table.allocate_many([AllocateRequest(node, seq_id, "t", hashes, num_blocks * BS)])[0]
        if isinstance(result, Allocation):
            self.live[seq_id] = family
            self._fresh(node, result.block_ids[result.num_cached_blocks:])

    @rule(family=st.integers(0, FAMILIES - 1), num_blocks=st.integers(1, 4))
    def popular_prompt(self, family: int, num_blocks: int) -> None:
        """The same prompt allocated and committed on every node (a shared system prompt): hashes
        that several nodes hold, so that removals from shared entries happen often."""
        hashes = [family_hash(family, i) for i in range(num_blocks)]
        for node in self.table.node_ids():
            self.count += 1
            seq_id = f"s{self.count}"
            result = self.table.allocate_many([AllocateRequest(node, seq_id, "t", hashes, num_blocks * BS)])[0]
            if isinstance(result, Allocation):
                self.live[seq_id] = family
                self._fresh(node, result.block_ids[result.num_cached_blocks:])
                self.table.commit([(seq_id, i, h) for i, h in enumerate(hashes)])
                for i, h in enumerate(hashes):
                    self.old.commit(node, result.block_ids[i], h)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), grow=st.integers(1, 3))
    def extend(self, data: st.DataObject, grow: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.table.sequence(seq_id)
        result = self.table.extend([(seq_id, seq.num_tokens + grow * BS)])[0]
        if isinstance(result, list):
            self._fresh(seq.node_id, result)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        """Blocks ``[num_dropped, upto)`` of a sequence in one call, as a node commits a prompt."""
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.table.sequence(seq_id)
        if seq.num_dropped == len(seq.block_ids):
            return
        upto = data.draw(st.integers(seq.num_dropped + 1, len(seq.block_ids)))
        commits = [(seq_id, i, family_hash(self.live[seq_id], i)) for i in range(seq.num_dropped, upto)]
        try:
            self.table.commit(commits)
        except FailedPrecondition:  # an adopted table shares a block committed with another hash
            return
        for _, i, h in commits:
            self.old.commit(seq.node_id, seq.block_ids[i], h)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(self.live)), min_size=1, max_size=3, unique=True))
        seqs = [self.table.sequence(s) for s in seq_ids]
        self.table.release(seq_ids)
        for seq in seqs:
            del self.live[seq.seq_id]
        for seq in seqs:
            self._unreferenced(seq.node_id, seq.held)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def drop_front(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        seq = self.table.sequence(seq_id)
        n = data.draw(st.integers(0, seq.num_tokens // BS))
        self.table.drop_front([(seq_id, n)])
        self._unreferenced(seq.node_id, [b for b in seq.block_ids[:n] if b != DROPPED])

    @rule(node=st.sampled_from(sorted(NODES)))
    def remove_node(self, node: str) -> None:
        """A node leaves (deregistered) and, if it was gone, comes back empty."""
        if node in self.table.node_ids():
            for s in self.table.deregister_node(node):
                del self.live[s]
            del self.old.index[node], self.old.hashes[node]
        else:
            self._register(node)

    @rule(node=st.sampled_from(sorted(NODES)), data=st.data())
    def sync(self, node: str, data: st.DataObject) -> None:
        """The node's own account: some of its sequences as they are (the others released) and one
        it holds that block_service never heard of, in blocks no listed sequence holds (claimed:
        a cached one loses its hash)."""
        if node not in self.table.node_ids():
            return
        mine = sorted(s for s in self.live if self.table.sequence(s).node_id == node)
        keep = data.draw(st.lists(st.sampled_from(mine), unique=True)) if mine else []
        listed = [LiveSequence(s, seq.tenant, tuple(seq.block_ids), seq.num_tokens)
                  for s in keep for seq in [self.table.sequence(s)]]
        held = {b for seq in listed for b in seq.block_ids}
        spare = [b for b in range(NODES[node]) if b not in held]
        claimed = data.draw(st.lists(st.sampled_from(spare), unique=True, max_size=3)) if spare else []
        self.count += 1
        adopted = f"s{self.count}"
        if claimed:
            listed.append(LiveSequence(adopted, "t", tuple(claimed), len(claimed) * BS))
        dropped = [s for s in mine if s not in keep]
        gone = [b for s in dropped for b in self.table.sequence(s).held]
        result = self.table.sync_node(node, NODES[node], BS, BPB, listed)
        assert not result.refused and sorted(result.released) == sorted(dropped)
        for s in dropped:
            del self.live[s]
        self._unreferenced(node, gone)
        for b in claimed:  # unreferenced until now: free, or cached and no longer
            self.old.forget(node, b)
        if claimed:
            self.live[adopted] = FAMILIES  # a family of its own: its commits name no probe's blocks

    @rule()
    def snapshot_round_trip(self) -> None:
        """Recovery rebuilds the index from the pools' snapshots."""
        restored = PageTable.from_dict(self.table.to_dict())
        assert restored.to_dict() == self.table.to_dict()
        self.table = restored

    @invariant()
    def matches_the_old_scan(self) -> None:
        if not hasattr(self, "table"):
            return
        nodes = self.table.node_ids()
        for probe in PROBES:
            expected = {n: self.old.scan(probe, n) for n in nodes}
            assert self.table.match_prefix(probe) == expected, probe
            for n in nodes:
                assert self.table.match_prefix(probe, [n]) == {n: expected[n]}

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "table"):
            self.table.check()


PrefixIndexMachine.TestCase.settings = settings(max_examples=examples(200), stateful_step_count=50, deadline=None)
TestPrefixIndexAgainstScan = PrefixIndexMachine.TestCase
