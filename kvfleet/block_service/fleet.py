"""The fleet's pools: every node's ``NodePool`` by id, the slot each holds in the indexes all pools
share (``PrefixIndex``: hash → nodes; ``LowerTiers``: what nodes hold below their pools), the
tenants' configuration every pool applies, and the eviction policy every pool uses.

The page table (``PageTable``) keeps the sequences and asks this for nodes; a node's slot is its bit
in the shared indexes, reused by the next node once the node is gone.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

from kvfleet.block_service.block_pool import BlockPool, validate_shape
from kvfleet.block_service.eviction import pinned, policy_class
from kvfleet.block_service.lower_tiers import LowerTiers, TierOutcome, validate_tier_change
from kvfleet.block_service.node_pool import NodePool
from kvfleet.block_service.prefix_index import MAX_SLOTS, PrefixIndex
from kvfleet.block_service.tenants import QuotaLedger, tenant_from_record, tenant_to_record
from kvfleet.block_service.validation import validate_hashes
from kvfleet.core.allocator import TierChange
from kvfleet.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kvfleet.core.ids import check_id
from kvfleet.core.tenants import Tenant


class Fleet:
    __slots__ = ("eviction", "nodes", "tenants", "index", "tiers", "_free_slots")

    def __init__(self, eviction: str) -> None:
        self.eviction = policy_class(eviction).name  # (an unknown name raises InvalidArgument)
        self.nodes: dict[str, NodePool] = {}
        self.tenants: dict[str, Tenant] = {}
        self.index = PrefixIndex()
        self.tiers = LowerTiers()
        self._free_slots: list[int] = []  # heap: a removed node's slot goes to the next new node

    def node(self, node_id: str) -> NodePool:
        node = self.nodes.get(node_id)
        if node is None:
            raise NotFound(f"unknown node {node_id!r}")
        return node

    def add(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int) -> bool:
        """Add a node's pool; True if new. Adding the same shape again is a no-op."""
        check_id("node_id", node_id)
        node = self.nodes.get(node_id)
        if node is not None:
            p = node.pool
            if (p.num_blocks, p.block_size, p.bytes_per_block) == (num_blocks, block_size, bytes_per_block):
                return False
            raise AlreadyExists(
                f"node {node_id!r} is registered with {p.num_blocks} blocks of {p.block_size} tokens, "
                f"{p.bytes_per_block} bytes; deregister it first to change its pool"
            )
        validate_shape(num_blocks, block_size, bytes_per_block)
        pool = BlockPool(num_blocks, block_size, bytes_per_block, self.index, self._take_slot(), self.eviction)
        node = NodePool(pool, QuotaLedger(bytes_per_block))
        node.configure(self.tenants.values())
        self.nodes[node_id] = node
        return True

    def remove(self, node_id: str) -> None:
        """Drop a node whose sequences are released: its hashes and lower tiers leave the indexes."""
        node = self.nodes.pop(node_id)
        assert not node.seq_ids, f"node {node_id!r} removed with live sequences"
        node.pool.unindex_all()
        self.tiers.drop(node.pool.slot)
        heapq.heappush(self._free_slots, node.pool.slot)

    def _take_slot(self) -> int:
        """The smallest slot no node holds (slots are the nodes' bits in the prefix index)."""
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        if len(self.nodes) >= MAX_SLOTS:
            raise FailedPrecondition(f"a page table holds at most {MAX_SLOTS} nodes")
        return len(self.nodes)

    def configure_tenants(self, configs: Iterable[Tenant], replace_all: bool = False) -> None:
        """Add or update tenants (``replace_all``: the given list is the whole set); API keys are
        dropped: block_service never holds them."""
        configs = [c.without_key() for c in configs]
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise InvalidArgument("a tenant appears twice in one configuration")
        tenants = {} if replace_all else dict(self.tenants)
        tenants.update((c.name, c) for c in configs)
        self.tenants = tenants
        for node in self.nodes.values():
            node.configure(tenants.values())

    def match_tiers(self, block_hashes: Sequence[bytes],
                    node_ids: Sequence[str] | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """``(hot, lower)``: per node (every node, or those named) how many leading blocks of the
        prompt are committed in its pool, and for the nodes holding any, how many blocks past those
        it holds in a lower tier (``LowerTiers.match``). Changes nothing. ``lower`` is sparse and
        costs nothing while no node holds a lower tier: the fleet-scale lookup stays as it was."""
        validate_hashes(block_hashes)
        nodes = [(n, self.node(n)) for n in node_ids] if node_ids else self.nodes.items()
        depth = self.index.match(block_hashes)
        hot = {n: depth.get(node.pool.slot, 0) for n, node in nodes}
        if self.tiers.empty:
            return hot, {}
        among = None
        if node_ids:
            among = 0
            for _, node in nodes:
                among |= 1 << node.pool.slot
        by_slot = self.tiers.match(block_hashes, self.index, depth, among)
        return hot, {n: by_slot[node.pool.slot] for n, node in nodes if node.pool.slot in by_slot} if by_slot else {}

    # ---- lower tiers ---------------------------------------------------------------------------

    def record_tiers(self, node_id: str, changes: Sequence[TierChange]) -> TierOutcome:
        """The node moved these committed blocks between its lower tiers (``TierChange``), in order.
        The batch is validated first (a bad change raises, nothing applied); a demotion past the
        tenant's lower-tier cap is refused alone (``TierOutcome.refused``: the node drops it)."""
        node = self.node(node_id)
        for c in changes:
            validate_tier_change(c)
        out = self.tiers.apply(node.pool.slot, changes, self.lower_caps(node))
        for t in out.refused_tenants:
            for c in (node.counters, node.tenant_counter(t)):
                c.refusals_lower_tier += 1
        return out

    def replace_tiers(self, node_id: str, held: Sequence[TierChange]) -> bool:
        """The node's whole lower-tier index is ``held`` (its own account, at a sync); True if
        that changed what this table had. Taken above a cap too: the node holds them already."""
        node = self.node(node_id)
        for c in held:
            validate_tier_change(c, replacing=True)
        return self.tiers.replace(node.pool.slot, held)

    def lower_tiers(self, node_id: str) -> list[TierChange]:
        """What the node holds below its pool, as this table knows it."""
        tiers = self.tiers.node(self.node(node_id).pool.slot)
        return tiers.changes() if tiers is not None else []

    def lower_caps(self, node: NodePool) -> dict[str, int]:
        """Each capped tenant's lower-tier cap on ``node``, in blocks."""
        bpb = node.pool.bytes_per_block
        caps = {}
        for t in self.tenants.values():
            q = t.lower_tier_quota_blocks(bpb)
            if q is not None:
                caps[t.name] = q
        return caps

    # ---- snapshots and checks ------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The tenants and the nodes (``PageTable.to_dict`` adds the rest)."""
        return {"tenants": [tenant_to_record(t) for t in self.tenants.values()],
                "nodes": {n: self._node_to_dict(node) for n, node in self.nodes.items()}}

    def _node_to_dict(self, node: NodePool) -> dict:
        d = node.to_dict()
        tiers = self.tiers.to_dict(node.pool.slot)
        if tiers is not None:  # absent: nothing below the pool (and snapshots before lower tiers)
            d["lower_tiers"] = tiers
        return d

    def restore(self, d: dict) -> None:
        """Become (from empty) the tenants and nodes ``to_dict`` described."""
        assert not self.nodes, "restore into a fleet with nodes"
        self.tenants = {t["name"]: tenant_from_record(t) for t in d["tenants"]}
        for slot, (node_id, nd) in enumerate(d["nodes"].items()):
            self.nodes[node_id] = NodePool.from_dict(nd, self.index, slot, self.tenants.values(), self.eviction)
            if "lower_tiers" in nd:
                self.tiers.restore(slot, nd["lower_tiers"])
        self.index.settle()  # the pools' hashes, indexed at once
        for node in self.nodes.values():
            if node.pins is not None:
                pinned.restore(node.pool, node.pins.pins)

    def check(self, indexed: int) -> None:
        """The shared indexes against the pools, which index ``indexed`` hashes in all."""
        self.index.check()
        self.tiers.check({n.pool.slot for n in self.nodes.values()})
        assert indexed == self.index.num_pairs, (
            f"the prefix index holds {self.index.num_pairs} (hash, node) pairs, the pools {indexed}")
        slots = sorted(n.pool.slot for n in self.nodes.values())
        assert len(set(slots)) == len(slots), "two nodes share a slot of the prefix index"
