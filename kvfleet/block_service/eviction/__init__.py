"""Which cached block a full pool gives up: a policy behind a small pure interface
(``policy.EvictionPolicy``), chosen by name from the one table below.

    lru         the least recently used cached block first; a release caches a table deepest
                block first, so the deepest block of the least recently released prefix goes
                first (``lru``)
    value       the cached block worth least first: clock + (1 + hits) x prefill tokens saved, the
                clock rising to each victim's (GreedyDual-Size-Frequency; ``value``)
    fair        the tenant furthest over its share of the cached blocks loses its least recently
                used one (``fair``)
    fair+value  fair's choice of tenant, value's choice within it (``fair``)

A page table uses one policy for all its pools (``PageTable(eviction=...)``); the name is part of
its durable state, and a state directory written under one policy is refused by a block_service
configured with another (``recovery``), since the same log would evict other blocks. Not configured
(``auto``), block_service takes its state directory's policy, else ``fair``; a standby that replays
under another policy than its leader's is sent the leader's snapshot, and takes its policy.
"""

from __future__ import annotations

from kvfleet.block_service.eviction.fair import FairShare, FairValue
from kvfleet.block_service.eviction.lru import BlockLru
from kvfleet.block_service.eviction.policy import CachedFacts, EvictionPolicy
from kvfleet.block_service.eviction.value import BlockValue
from kvfleet.core.errors import InvalidArgument

# fair: kept the steady tenant's hit rate (0.97 of it alone) under another's flood where lru kept 0.65,
# at no cost to the flood's throughput, and with one tenant it is lru (BENCHMARKS.md "Tenant fairness")
DEFAULT_POLICY = FairShare.name
AUTO = "auto"  # the setting's default: a state directory's own policy, else DEFAULT_POLICY
POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (BlockLru, BlockValue, FairShare, FairValue)}
NAMES = tuple(POLICIES)  # the names a block_service accepts (the tests register more in POLICIES)

__all__ = ["AUTO", "DEFAULT_POLICY", "NAMES", "POLICIES", "CachedFacts", "EvictionPolicy", "policy_class"]


def policy_class(name: str) -> type[EvictionPolicy]:
    """The policy called ``name``; ``InvalidArgument`` naming the known ones for any other."""
    cls = POLICIES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgument(f"unknown eviction policy {name!r}; known: {', '.join(sorted(POLICIES))}")
    return cls
