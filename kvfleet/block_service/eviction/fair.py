"""``fair`` and ``fair+value``: every tenant has a share of a node's cached blocks, and the tenant
furthest over its share gives up the next victim — under ``fair`` its least recently used cached
block, under ``fair+value`` its least valuable one (``value``'s rule, with a clock per tenant).

A tenant's share is ``cache_share_mib`` from the tenants file, else its ``reserved_mib``, in the
node's blocks (``kvfleet.core.tenants.Tenant.cache_share_blocks``; told by ``set_shares``). "Furthest
over" compares cached blocks held / share:

- a tenant with no share (none configured, an unconfigured tenant, a share of 0) is over it with
  any block, and goes before every tenant that has one: a flood by a tenant without a share evicts
  its own blocks first and never a tenant's within its share while it has any cached;
- among tenants with a share, the largest held / share first (compared as integers:
  ``held_a * share_b`` against ``held_b * share_a``);
- ties (all tenants without a share, or equal ratios): the one holding more cached blocks, then the
  name. With no shares at all the rule still evens the cache out: the largest holder goes first.

Shares are weights. Only their ratios to the blocks held decide, so shares that sum past a node's
pool need no scaling (a node's pool is known only when it registers, after the tenants file is
read): the order is the one shares scaled down to the pool would give. A tenant within its share
loses a block only when no tenant over its share has a cached block left.

The reason a victim went (``reason``, a metrics label): ``over_share`` when its tenant held more
cached blocks than its share (or had none), ``within_share`` otherwise. Choosing the tenant is
O(tenants holding blocks in the pool) per eviction; the tenants are configured names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvfleet.block_service.eviction.heap_policy import HeapPolicy
from kvfleet.block_service.eviction.policy import CachedFacts
from kvfleet.block_service.eviction.value import gdsf_worth

OVER_SHARE, WITHIN_SHARE = "over_share", "within_share"


def furthest_over(held: Sequence[int], shares: Sequence[int], names: Sequence[str]) -> int:
    """The index of the tenant to lose a block: ``held[i]`` cached blocks against ``shares[i]``
    (0: none), ties by more held, then by name; some ``held[i]`` must be positive."""
    best = -1
    for i, h in enumerate(held):
        if not h:
            continue
        if best < 0:
            best = i
            continue
        s, bh, bs = shares[i], held[best], shares[best]
        if (s == 0) != (bs == 0):
            better = s == 0
        else:
            x, y = h * bs, bh * s  # h/s against bh/bs (both shares 0: both 0, equal)
            better = x > y if x != y else (h > bh if h != bh else names[i] < names[best])
        if better:
            best = i
    assert best >= 0, "no tenant holds a cached block"
    return best


class FairShare(HeapPolicy):
    """A bucket per tenant, least recently used first within it."""

    __slots__ = ("_shares",)
    name = "fair"
    per_tenant = True

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._shares: list[int] = []  # per bucket, ``shares`` by tenant

    def _bucket(self, tenant: str) -> int:
        k = super()._bucket(tenant)
        if k == len(self._shares):
            self._shares.append(self.shares.get(tenant, 0))
        return k

    def set_shares(self, shares: Mapping[str, int]) -> None:
        self.shares = dict(shares)
        self._shares = [self.shares.get(t, 0) for t in self.names]

    def choose(self, held: Sequence[int]) -> int:
        return furthest_over(held, self._shares, self.names)

    def reason_for(self, k: int) -> str:
        share = self._shares[k]
        return WITHIN_SHARE if share and self.held[k] <= share else OVER_SHARE


class FairValue(FairShare):
    """``fair``'s choice of tenant, ``value``'s choice within it."""

    __slots__ = ()
    name = "fair+value"

    def worth(self, facts: CachedFacts) -> list[int]:
        return gdsf_worth(facts)
