"""Tenants' KV quotas on the page table: one node's ledger of charged blocks, and the tenants'
record form in the log and snapshots.

The tenant itself is ``kvfleet.core.tenants.Tenant`` (one type, one validation, shared with the router);
block_service keeps it without its API key. A quota is configured in MiB and becomes
``quota_bytes // bytes_per_block`` blocks on each node. A block is charged to the tenant that
brought it into use (fresh, or revived from the cache) for as long as any sequence holds it, so a
shared prefix block is charged once (docs/design.md invariant 3). A reserved share is guaranteed: other
tenants may not take the blocks a tenant has reserved and not yet used. A tenant without a
configured quota is unlimited (the engine's in-process tenant).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvfleet.core.tenants import MIB, Tenant, load_tenants

log = logging.getLogger(__name__)

_RECORD_FIELDS = ("name", "quota_mib", "reserved_mib", "paid_level", "max_concurrent", "lower_tier_quota_mib",
                  "cache_share_mib", "pinned_mib")


def tenant_to_record(t: Tenant) -> dict:
    """The form a tenant takes in the log and in snapshots: never with its API key."""
    return {f: getattr(t, f) for f in _RECORD_FIELDS}


def tenant_from_record(d: Mapping) -> Tenant:
    """Reads the record form, and the older one too (``TenantConfig``'s, with an empty ``api_key``)."""
    return Tenant(**{f: d[f] for f in _RECORD_FIELDS if f in d})


def cache_shares(tenants: Iterable[Tenant], bytes_per_block: int) -> dict[str, int]:
    """Each tenant's share of a node's cached blocks, for its eviction policy (``set_shares``);
    tenants without one are absent."""
    shares = {t.name: t.cache_share_blocks(bytes_per_block) for t in tenants}
    return {name: n for name, n in shares.items() if n}


@dataclass(slots=True, frozen=True)
class PoolShape:
    """What the tenants' MiB are checked against: one registered node's pool."""

    node_id: str
    num_blocks: int
    bytes_per_block: int


def pool_misfits(tenants: Iterable[Tenant], pools: Iterable[PoolShape]) -> tuple[list[str], list[str]]:
    """What the nodes' pools cannot honour of ``tenants``, one line each: ``(refused, warned)``.

    Refused: a tenant's ``pinned_mib`` past a node's whole pool (it could pin every block and
    starve everyone: a typo, not a budget); ``ConfigureTenants`` answers it ``INVALID_ARGUMENT``
    and changes nothing. Warned (logged, applied): cache shares summing past a pool (they are
    weights: the fair policies order by held / share, so they need no scaling), reserved shares
    summing past a pool (a tenant without a reservation may then be refused every block), pin
    budgets summing past a pool (pins may then hold every cached block). A node's pool is known
    only once it registers, so at start-up and at a registration both kinds are only logged."""
    tenants = list(tenants)
    refused: list[str] = []
    warned: list[str] = []
    for p in pools:
        where = f"node {p.node_id}'s pool of {p.num_blocks} blocks ({p.num_blocks * p.bytes_per_block / MIB:g} MiB)"
        for t in tenants:
            n = t.pinned_blocks(p.bytes_per_block)
            if n > p.num_blocks:
                refused.append(f"tenant {t.name!r}: pinned_mib {t.pinned_mib:g} is {n} blocks, past {where}")
        explicit = any(t.cache_share_mib is not None for t in tenants)  # else shares are the reservations
        for what, total in (("cache shares", sum(cache_shares(tenants, p.bytes_per_block).values()) if explicit else 0),
                            ("reserved shares", sum(t.reserved_blocks(p.bytes_per_block) for t in tenants)),
                            ("pin budgets", sum(t.pinned_blocks(p.bytes_per_block) for t in tenants))):
            if total > p.num_blocks:
                warned.append(f"tenants' {what} sum to {total} blocks, past {where}: {_CONSEQUENCE[what]}")
    return refused, warned


_CONSEQUENCE = {
    "cache shares": "they act as weights (the fair policies need no scaling)",
    "reserved shares": "a tenant without a reservation may be refused every block",
    "pin budgets": "pins may hold every cached block",
}


def configured(current: Iterable[Tenant], configs: Iterable[Tenant], replace_all: bool) -> list[Tenant]:
    """The tenants a configuration leaves: ``configs`` alone (``replace_all``), else ``current``
    with ``configs`` added or updated (``Fleet.configure_tenants``' rule)."""
    tenants = {} if replace_all else {t.name: t for t in current}
    tenants.update((t.name, t) for t in configs)
    return list(tenants.values())


def load_tenants_without_keys(path: str) -> list[Tenant]:
    """The tenants file as block_service keeps it: keys never reach its log or snapshots. A bad
    file raises ``kvfleet.core.tenants.TenantsFileError``."""
    return [t.without_key() for t in load_tenants(path)]


class QuotaLedger:
    """Blocks charged per tenant on one node, against quotas and reserved shares.

    ``grace[t]`` keeps a quota cut honest: blocks charged beyond a quota lowered by configuration
    stay until released (the grace shrinks with them) and no new block is granted meanwhile.
    """

    __slots__ = ("bytes_per_block", "charged", "allowed", "reserved", "grace", "_reserved_unused")

    def __init__(self, bytes_per_block: int) -> None:
        self.bytes_per_block = bytes_per_block
        self.charged: dict[str, int] = {}
        self.allowed: dict[str, int] = {}   # limited tenants only
        self.reserved: dict[str, int] = {}  # tenants with a reserved share only
        self.grace: dict[str, int] = {}
        self._reserved_unused = 0           # sum over tenants of max(0, reserved - charged)

    def configure(self, tenants: Iterable[Tenant]) -> None:
        self.allowed, self.reserved = {}, {}
        for t in tenants:
            quota = t.quota_blocks(self.bytes_per_block)
            if quota is not None:
                self.allowed[t.name] = quota
            if t.reserved_mib:
                self.reserved[t.name] = t.reserved_blocks(self.bytes_per_block)
        self.grace = {}
        for name, quota in self.allowed.items():
            over = self.charged.get(name, 0) - quota
            if over > 0:
                self.grace[name] = over
        self._reserved_unused = sum(self._unused(name) for name in self.reserved)

    def _unused(self, tenant: str) -> int:
        return max(0, self.reserved.get(tenant, 0) - self.charged.get(tenant, 0))

    def quota_shortfall(self, tenant: str, n: int) -> int | None:
        """None if ``n`` more blocks fit in the tenant's quota, else the blocks allowed."""
        allowed = self.allowed.get(tenant)
        if allowed is None or self.charged.get(tenant, 0) + n <= allowed:
            return None
        return allowed

    def reserved_for_others(self, tenant: str) -> int:
        """Blocks other tenants have reserved and not used: not available to ``tenant``."""
        return self._reserved_unused - self._unused(tenant)

    def charge(self, tenant: str, n: int) -> None:
        if not n:
            return
        before = self._unused(tenant)
        self.charged[tenant] = self.charged.get(tenant, 0) + n
        self._reserved_unused += self._unused(tenant) - before

    def charge_granted(self, tenant: str, n: int) -> None:
        """Charge blocks a node already holds (adopted by ``sync_node``): never refused, so beyond
        the quota the excess becomes grace, as for a quota cut (nothing new is granted meanwhile)."""
        self.charge(tenant, n)
        allowed = self.allowed.get(tenant)
        over = self.charged.get(tenant, 0) - allowed if allowed is not None else 0
        if over > self.grace.get(tenant, 0):
            self.grace[tenant] = over

    def uncharge(self, tenant: str, n: int) -> None:
        before = self._unused(tenant)
        left = self.charged[tenant] - n
        assert left >= 0, f"tenant {tenant!r} uncharged below zero"
        if left:
            self.charged[tenant] = left
        else:
            del self.charged[tenant]
        self._reserved_unused += self._unused(tenant) - before
        g = self.grace.get(tenant)
        if g is not None:
            g = min(g, left - self.allowed[tenant])
            if g > 0:
                self.grace[tenant] = g
            else:
                del self.grace[tenant]

    def to_dict(self) -> dict:
        return {"charged": dict(self.charged), "grace": dict(self.grace)}

    def restore(self, d: dict, tenants: Iterable[Tenant]) -> None:
        self.charged = dict(d["charged"])
        self.configure(tenants)
        self.grace = dict(d["grace"])

    def check(self, charged: Mapping[str, int]) -> None:
        """Invariant 3: ``charged`` recounted from the pool matches, and stays within quota."""
        assert dict(charged) == self.charged, f"ledger {self.charged} != pool owners {dict(charged)}"
        for name, n in self.charged.items():
            allowed = self.allowed.get(name)
            if allowed is not None:
                assert n <= allowed + self.grace.get(name, 0), (
                    f"tenant {name!r} charged {n} blocks, quota {allowed}"
                )
        assert self._reserved_unused == sum(self._unused(n) for n in self.reserved)
