"""Which committed blocks each node keeps below its device pool, and for which tenant.

A node demotes a committed block block_service evicted from its pool into host memory instead of
dropping it, may move it on to disk, and promotes it back on a prefix hit; it tells block_service
each move (``kvfleet.core.allocator.TierChange``). This index keeps, per node, ``hash → (tier, tenant)``
so that a prefix lookup can say how far past its hot run a node could serve a prompt without
prefill, and so that each tenant's lower-tier cap is charged. It is apart from the hot
``PrefixIndex`` on purpose: the hot lookup stays exactly as fast (it is what routing asks first,
and must hold at fleet scale), and lower-tier entries never change a pool's block state.

Layout, for the fleet-wide question (``match``) and the per-node accounts:

    masks   hash → bitset of the slots (nodes) holding it in a lower tier (a Python int)
    nodes   slot → NodeTiers: hash → tenant_code * 4 + tier_code, counts per tier and tenant

A cap is per tenant and node, in blocks (``Tenant.lower_tier_quota_blocks``), like the hot quota.
A demotion that would take a tenant past its cap is refused, item by item (the rest applied), and
the node drops its copy. A move between lower tiers, or of a block already held, never charges
anything new. A whole index replaced from the node (``replace``: after a restart of block_service
or a reconciliation) is taken as the node holds it, above a cap too (a cap cut: new demotions are
refused until the tenant is under it again), as adopted sequences are.

Pure: no grpc, no torch.
"""

from __future__ import annotations

import base64
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvfleet.block_service.prefix_index import PrefixIndex
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, TierChange
from kvfleet.core.block_hash import HASH_BYTES
from kvfleet.core.errors import InvalidArgument
from kvfleet.core.ids import check_id

TIER_CODES = {TIER_HOST: 1, TIER_DISK: 2}
TIER_NAMES = {1: TIER_HOST, 2: TIER_DISK}
LOWER_TIERS = (TIER_HOST, TIER_DISK)


def validate_tier_change(c: TierChange, replacing: bool = False) -> None:
    """Raise ``InvalidArgument`` saying what is wrong with one change (a whole index given by
    ``replace`` lists held blocks only: no ``TIER_NONE``)."""
    if type(c.block_hash) is not bytes or len(c.block_hash) != HASH_BYTES:
        raise InvalidArgument(f"a tier change's block hash must be {HASH_BYTES} bytes, got {c.block_hash!r:.40}")
    allowed = LOWER_TIERS if replacing else (*LOWER_TIERS, TIER_NONE)
    if c.tier not in allowed:
        raise InvalidArgument(f"tier must be one of {', '.join(map(repr, allowed))}, got {c.tier!r}")
    check_id("tenant", c.tenant)


@dataclass(slots=True)
class TierOutcome:
    """What ``LowerTiers.apply`` did: the changes that changed the index (for the log), in order,
    and the hashes whose demotion the tenant's cap refused (the node drops its copies)."""

    applied: list[TierChange] = field(default_factory=list)
    refused: list[bytes] = field(default_factory=list)
    refused_tenants: list[str] = field(default_factory=list)  # one per refused hash (counters)


class NodeTiers:
    """One node's lower tiers: ``hash → tenant_code * 4 + tier_code`` and its counts."""

    __slots__ = ("entries", "tenants", "codes", "per_tier", "per_tenant")

    def __init__(self) -> None:
        self.entries: dict[bytes, int] = {}
        self.tenants: list[str] = []          # code → name (codes are never reused: a short list)
        self.codes: dict[str, int] = {}
        self.per_tier = [0, 0, 0]             # by tier code (index 0 unused)
        self.per_tenant: dict[str, int] = {}  # blocks charged to each tenant's lower-tier cap

    def code(self, tenant: str) -> int:
        c = self.codes.get(tenant)
        if c is None:
            c = self.codes[tenant] = len(self.tenants)
            self.tenants.append(tenant)
        return c

    def get(self, h: bytes) -> tuple[str, str] | None:
        """``(tier, tenant)`` of ``h`` here, or None."""
        v = self.entries.get(h)
        return None if v is None else (TIER_NAMES[v & 3], self.tenants[v >> 2])

    def recount(self, v: int, n: int) -> None:
        """Count the entry ``v`` ``n`` times more (1: added, -1: removed) in its tier and tenant."""
        self.per_tier[v & 3] += n
        t = self.tenants[v >> 2]
        left = self.per_tenant.get(t, 0) + n
        if left:
            self.per_tenant[t] = left
        else:
            del self.per_tenant[t]

    def changes(self) -> list[TierChange]:
        """The whole index as changes that would rebuild it (snapshots, checks, tests)."""
        return [TierChange(h, self.tenants[v >> 2], TIER_NAMES[v & 3]) for h, v in self.entries.items()]

    @property
    def counts(self) -> dict[str, int]:
        return {TIER_HOST: self.per_tier[1], TIER_DISK: self.per_tier[2]}


class LowerTiers:
    """Every node's lower tiers, by the node's slot in the prefix index (``PageTable`` gives it)."""

    __slots__ = ("_masks", "_nodes", "_tiered")

    def __init__(self) -> None:
        self._masks: dict[bytes, int] = {}
        self._nodes: dict[int, NodeTiers] = {}
        self._tiered = 0  # bitset of the slots holding at least one block in a lower tier

    @property
    def empty(self) -> bool:
        """No node holds anything below its pool (a lookup has nothing more to do)."""
        return not self._tiered

    def node(self, slot: int) -> NodeTiers | None:
        return self._nodes.get(slot)

    def counts(self, slot: int) -> dict[str, int]:
        """Blocks the node holds per lower tier."""
        n = self._nodes.get(slot)
        return n.counts if n is not None else {TIER_HOST: 0, TIER_DISK: 0}

    def charged(self, slot: int) -> dict[str, int]:
        """Blocks charged per tenant to its lower-tier cap on the node."""
        n = self._nodes.get(slot)
        return dict(n.per_tenant) if n is not None else {}

    def __len__(self) -> int:
        """(hash, node) pairs held in lower tiers, fleet-wide."""
        return sum(len(n.entries) for n in self._nodes.values())

    # ---- changes ----------------------------------------------------------------------------------

    def apply(self, slot: int, changes: Sequence[TierChange], caps: Mapping[str, int]) -> TierOutcome:
        """Apply valid ``changes`` (``validate_tier_change``) in order. ``caps``: blocks each
        limited tenant may hold in the node's lower tiers (absent: unlimited)."""
        out = TierOutcome()
        node = self._nodes.get(slot)
        if node is None:
            node = self._nodes[slot] = NodeTiers()
        for c in changes:
            h = c.block_hash
            old = node.entries.get(h)
            if c.tier == TIER_NONE:
                if old is not None:
                    self._remove(node, slot, h, old)
                    out.applied.append(c)
                continue
            v = node.code(c.tenant) * 4 + TIER_CODES[c.tier]
            if old == v:
                continue
            if old is None or old >> 2 != v >> 2:  # a new charge for this tenant
                cap = caps.get(c.tenant)
                if cap is not None and node.per_tenant.get(c.tenant, 0) + 1 > cap:
                    if old is not None:  # the node drops its copy: block_service forgets it too
                        self._remove(node, slot, h, old)
                    out.refused.append(h)
                    out.refused_tenants.append(c.tenant)
                    continue
            if old is None:
                self._masks[h] = self._masks.get(h, 0) | 1 << slot
            else:
                node.recount(old, -1)
            node.entries[h] = v
            node.recount(v, 1)
            out.applied.append(c)
        self._settle(slot, node)
        return out

    def replace(self, slot: int, held: Sequence[TierChange]) -> bool:
        """The node's whole lower-tier index is ``held`` (valid, ``replacing``; a hash listed twice:
        the last wins); True if that changed anything."""
        old = self._nodes.get(slot)
        before = old.changes() if old is not None else []
        fresh = {c.block_hash: c for c in held}
        if {c.block_hash: c for c in before} == fresh:
            return False
        self.drop(slot)
        self.apply(slot, list(fresh.values()), {})
        return True

    def drop(self, slot: int) -> None:
        """Forget the node's lower tiers (it deregistered, or its pool was released)."""
        node = self._nodes.pop(slot, None)
        if node is None:
            return
        bit = 1 << slot
        masks = self._masks
        for h in node.entries:
            m = masks[h] & ~bit
            if m:
                masks[h] = m
            else:
                del masks[h]
        self._tiered &= ~bit

    def _remove(self, node: NodeTiers, slot: int, h: bytes, old: int) -> None:
        del node.entries[h]
        node.recount(old, -1)
        m = self._masks[h] & ~(1 << slot)
        if m:
            self._masks[h] = m
        else:
            del self._masks[h]

    def _settle(self, slot: int, node: NodeTiers) -> None:
        if node.entries:
            self._tiered |= 1 << slot
        else:
            del self._nodes[slot]
            self._tiered &= ~(1 << slot)

    # ---- the fleet-wide question ----------------------------------------------------------------

    def match(self, hashes: Sequence[bytes], hot: PrefixIndex, hot_depth: Mapping[int, int],
              among: int | None = None) -> dict[int, int]:
        """Per slot, how many blocks past its hot run (``hot_depth``, from ``hot.match``) the node
        holds in any tier, up to the first block it holds nowhere; slots with none are left out.
        ``among``: a bitset of the slots asked about (None: all). Costs nothing when no node holds
        a lower tier; otherwise one walk of the prompt with two dict lookups per block, ending when
        no node asked about still holds the prefix."""
        cur = self._tiered if among is None else self._tiered & among
        if not cur or not hashes:
            return {}
        return {s: n - hot_depth.get(s, 0) for s, n in hot.match_past(hashes, self._masks, cur).items()}

    # ---- snapshots and checks ---------------------------------------------------------------------

    def to_dict(self, slot: int) -> dict | None:
        """The node's index for a snapshot (None: it holds nothing below its pool): its hashes and
        codes as base64 arrays, not one JSON value per block."""
        node = self._nodes.get(slot)
        if node is None:
            return None
        return {"tenants": list(node.tenants),
                "hashes": base64.b64encode(b"".join(node.entries)).decode(),
                "codes": base64.b64encode(array("I", node.entries.values()).tobytes()).decode()}

    def restore(self, slot: int, d: dict) -> None:
        """Load what ``to_dict`` wrote for a node into ``slot`` (which holds nothing yet)."""
        hashes = base64.b64decode(d["hashes"])
        codes = array("I")
        codes.frombytes(base64.b64decode(d["codes"]))
        tenants = d["tenants"]
        self.apply(slot, [TierChange(hashes[i * HASH_BYTES:(i + 1) * HASH_BYTES], tenants[v >> 2], TIER_NAMES[v & 3])
                          for i, v in enumerate(codes)], {})

    def check(self, slots: set[int]) -> None:
        """The masks are exactly the nodes' entries, the counts their sums, every slot a node's."""
        masks: dict[bytes, int] = {}
        tiered = 0
        for slot, node in self._nodes.items():
            assert slot in slots, f"lower tiers kept for slot {slot}, which no node holds"
            assert node.entries, f"slot {slot}: an empty lower-tier index is kept"
            tiered |= 1 << slot
            per_tier, per_tenant = [0, 0, 0], {}
            for h, v in node.entries.items():
                masks[h] = masks.get(h, 0) | 1 << slot
                per_tier[v & 3] += 1
                t = node.tenants[v >> 2]
                per_tenant[t] = per_tenant.get(t, 0) + 1
            assert per_tier == node.per_tier, f"slot {slot}: tier counts {node.per_tier} != {per_tier}"
            assert per_tenant == node.per_tenant, f"slot {slot}: tenant counts {node.per_tenant} != {per_tenant}"
        assert masks == self._masks, "the lower-tier masks differ from the nodes' entries"
        assert tiered == self._tiered, "the set of tiered slots differs from the nodes'"
