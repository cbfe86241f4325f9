"""Pins: per (node, block hash), a tenant's word that the node's cached block holding that hash is
not evicted, by any policy, until an absolute expiry (a request's ``cache.pin``). Pure.

A pin costs its tenant one block of its budget on the node (``Tenant.pinned_blocks`` of the node's
``bytes_per_block``: ``pinned_mib`` in the tenants file), whether the block is there yet or not —
a pin made before the prompt's first prefill holds the blocks as soon as they are cached. Pinning
a pinned hash again moves its expiry (to the later of the two when another tenant of its prefix
group pinned it) and costs nothing more, even over a lowered budget. Past the budget the whole pin is refused
(``ResourceExhausted``, one line saying what it may pin and what it holds); a tenant with no budget
(``pinned_mib`` 0, or not in the tenants file) gets ``FailedPrecondition``. A reload of the tenants
file that lowers a budget keeps the pins made under the old one until they expire (nothing cached is
lost by a reload); only new pins are refused until the tenant is under its budget again.

Expiry is an explicit change, never a clock read inside the table: the leader asks ``due(now)``
and ends those pins with ``expire`` (each call one log record), so that a replayed log and a
restored snapshot hold and release exactly the blocks the live table did. The node's cached block
of a pinned hash is held aside by its pool's ``PinnedPolicy`` (``eviction.pinned``); a pin ends with
its node when the node leaves the table (deregistered, or registered again with another shape).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.block_service.eviction import pinned
from kvfleet.block_service.validation import validate_hashes
from kvfleet.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvfleet.core.ids import check_id

DEFAULT_TTL_S = 3600
MAX_TTL_S = 7 * 24 * 3600
MAX_EXPIRY = 1 << 62  # absolute unix seconds beyond any clock (a log record holds a u64)


@dataclass(slots=True)
class Pin:
    tenant: str       # charged for it
    expires_at: int   # unix seconds: ended by the first expiry at or after it
    cost: int         # prefill tokens a hit reaching the block saves (its position in the pinned prompt)


@dataclass(slots=True, frozen=True)
class PinResult:
    num_pinned: int     # distinct hashes pinned by the call (new and refreshed)
    num_new: int        # of them, charged by it
    tenant_pinned: int  # the tenant's pins on the node now
    allowed: int        # its budget there, in blocks
    expires_at: int


@dataclass(slots=True, frozen=True)
class TenantPins:
    tenant: str
    node_id: str
    pinned: int     # pins held
    allowed: int    # the budget now (a lowered budget keeps older pins: pinned may exceed it)
    cached: int     # pins whose block is on the node (cached or in use)
    earliest: int   # the first expiry, unix seconds


def check_ttl(ttl_s: int) -> int:
    """A pin's time to live: 1 .. ``MAX_TTL_S`` seconds; ``InvalidArgument`` otherwise."""
    if not isinstance(ttl_s, int) or isinstance(ttl_s, bool) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidArgument(f"a pin's ttl must be 1..{MAX_TTL_S} seconds (7 days), got {ttl_s!r}")
    return ttl_s


class NodePins:
    """One node's pins by hash (insertion order: deterministic), and the count per tenant."""

    __slots__ = ("pins", "counts")

    def __init__(self) -> None:
        self.pins: dict[bytes, Pin] = {}
        self.counts: dict[str, int] = {}

    def add(self, h: bytes, pin: Pin) -> None:
        self.pins[h] = pin
        self.counts[pin.tenant] = self.counts.get(pin.tenant, 0) + 1

    def remove(self, h: bytes) -> Pin | None:
        pin = self.pins.pop(h, None)
        if pin is not None:
            n = self.counts[pin.tenant] - 1
            if n:
                self.counts[pin.tenant] = n
            else:
                del self.counts[pin.tenant]
        return pin

    def to_list(self) -> list[list]:
        return [[h.hex(), p.tenant, p.expires_at, p.cost] for h, p in self.pins.items()]

    @classmethod
    def from_list(cls, rows: Sequence[Sequence]) -> NodePins:
        pins = cls()
        for h, tenant, expires_at, cost in rows:
            pins.add(bytes.fromhex(h), Pin(str(tenant), int(expires_at), int(cost)))
        return pins


class FleetPins:
    """The pins of every node of a fleet (``PageTable.pins``)."""

    __slots__ = ("fleet",)

    def __init__(self, fleet) -> None:
        self.fleet = fleet  # a ``fleet.Fleet`` (not imported: it imports this module's user)

    def pin(self, node_id: str, tenant: str, block_hashes: Sequence[bytes], expires_at: int) -> PinResult:
        """Pin ``block_hashes`` (a prompt's leading blocks, in order) on the node for ``tenant``
        until ``expires_at``; refused whole, having changed nothing, past the tenant's budget."""
        node = self.fleet.node(node_id)
        check_id("tenant", tenant)
        validate_hashes(block_hashes)
        if not block_hashes:
            raise InvalidArgument("a pin names at least one block hash")
        if not isinstance(expires_at, int) or isinstance(expires_at, bool) or not 0 < expires_at < MAX_EXPIRY:
            raise InvalidArgument(f"a pin's expiry must be positive unix seconds, got {expires_at!r}")
        cfg = self.fleet.tenants.get(tenant)
        pool = node.pool
        allowed = cfg.pinned_blocks(pool.bytes_per_block) if cfg is not None else 0
        if cfg is None or cfg.pinned_mib <= 0:
            why = "is not in the tenants file" if cfg is None else "has pinned_mib 0"
            raise FailedPrecondition(f"tenant {tenant!r} may not pin: it {why} (give it pinned_mib in the tenants file)")
        pins = node.pins if node.pins is not None else NodePins()
        new = [h for h in block_hashes if h not in pins.pins]
        have = pins.counts.get(tenant, 0)
        if new and have + len(new) > allowed:  # (a refresh charges nothing: allowed over a lowered budget)
            raise ResourceExhausted(
                f"tenant {tenant!r} may pin {allowed} blocks (pinned_mib {cfg.pinned_mib:g}) on node {node_id!r}; "
                f"{have} pinned, this pin needs {len(new)} more")
        node.pins = pins
        policy = pinned.install(pool, pins.pins)
        index, slot, ref, bs = pool._index, pool.slot, pool.ref, pool.block_size
        for k, h in enumerate(block_hashes):
            pin = pins.pins.get(h)
            if pin is not None:
                pin.expires_at = expires_at if pin.tenant == tenant else max(pin.expires_at, expires_at)
                continue
            pins.add(h, Pin(tenant, expires_at, (k + 1) * bs))
            b = index.block(h, slot)
            if b is not None and ref[b] == 0:
                policy.hold(b)
        return PinResult(len(block_hashes), len(new), pins.counts.get(tenant, 0), allowed, expires_at)

    def expire(self, node_id: str, block_hashes: Sequence[bytes]) -> int:
        """End these pins of the node (those it holds), in order; their held blocks go back to the
        eviction policy. Returns how many ended."""
        node = self.fleet.node(node_id)
        validate_hashes(block_hashes)
        pins = node.pins
        if pins is None:
            return 0
        pool = node.pool
        policy = pinned.install(pool, pins.pins)
        ended = 0
        for h in block_hashes:
            pin = pins.remove(h)
            if pin is None:
                continue
            ended += 1
            b = pool._index.block(h, pool.slot)
            if b is not None and b in policy.held:
                policy.unhold(b, pin.cost)
        return ended

    def due(self, now: float) -> list[tuple[str, list[bytes]]]:
        """Per node holding any, the pins expired at ``now``, the earliest first. Changes nothing."""
        out = []
        for node_id, node in self.fleet.nodes.items():
            if node.pins is not None and node.pins.pins:
                gone = sorted((p.expires_at, h) for h, p in node.pins.pins.items() if p.expires_at <= now)
                if gone:
                    out.append((node_id, [h for _, h in gone]))
        return out

    def summary(self) -> list[TenantPins]:
        """Per node and tenant holding pins: how many, the budget, how many are on the node, the
        first expiry."""
        out = []
        for node_id, node in self.fleet.nodes.items():
            if node.pins is None or not node.pins.pins:
                continue
            pool = node.pool
            per: dict[str, list[int]] = {}
            for h, p in node.pins.pins.items():
                row = per.setdefault(p.tenant, [0, 0, p.expires_at])
                row[0] += 1
                row[1] += pool._index.block(h, pool.slot) is not None
                row[2] = min(row[2], p.expires_at)
            for t, (n, cached, earliest) in sorted(per.items()):
                cfg = self.fleet.tenants.get(t)
                allowed = cfg.pinned_blocks(pool.bytes_per_block) if cfg is not None else 0
                out.append(TenantPins(t, node_id, n, allowed, cached, earliest))
        return out


def check(node) -> None:
    """The held blocks of a ``NodePool`` are exactly its cached blocks whose hash is pinned."""
    pool = node.pool
    policy = pool._policy
    if not isinstance(policy, pinned.PinnedPolicy):
        assert node.pins is None or not node.pins.pins, "a node holds pins but its policy does not know them"
        return
    pins = node.pins.pins if node.pins is not None else {}
    expect = set()
    for h in pins:
        b = pool._index.block(h, pool.slot)
        if b is not None and pool.ref[b] == 0:
            expect.add(b)
    assert policy.held == expect, f"held blocks {sorted(policy.held)} are not the pinned cached ones {sorted(expect)}"
    assert policy.held.isdisjoint(policy.inner), "a pinned block is also in the eviction policy's reach"
    assert sum(node.pins.counts.values()) == len(pins) if node.pins is not None else True
