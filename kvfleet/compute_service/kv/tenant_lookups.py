"""Prefix-cache lookups per tenant, and the tier each hit came from. Pure Python.

vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, kept per tenant at admission (in blocks;
the node's metrics turn them into tokens). A query is a full block of the prompt the engine may
reuse; a hit is one it did not compute, by where it was found:

    device  committed in the node's pool (computed here, or brought in by an earlier request)
    host    promoted from the host tier instead of recomputed
    disk    promoted from the disk tier
    peer    in the pool because a fetch from a peer put it there for this prompt (its first hit;
            later hits on it are ``device``)

So the device and peer hits of a node add up to what its page table counts as prefix hits, and
all four to the prompt blocks it did not prefill. The node's own warm-up requests
(``kvfleet.core.tenants.WARMUP_TENANT``) are not counted: they are not a tenant's traffic. Tenants are
the tenants file's, so the labels stay bounded.

The counts are replaced, never changed (``add`` builds a new mapping), so a reading handed to
the metrics thread stays as it was while the engine thread counts on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvfleet.core.allocator import TIER_DISK, TIER_HOST
from kvfleet.core.tenants import WARMUP_TENANT

DEVICE, HOST, DISK, PEER = "device", "host", "disk", "peer"
TIERS = (DEVICE, HOST, DISK, PEER)
FETCHED_MEMORY = 1 << 16  # fetched blocks remembered until their first hit (older ones: counted as device)


@dataclass(slots=True, frozen=True)
class TenantLookups:
    """One tenant's lookups on a node since it started, in blocks."""

    queries: int = 0  # prompt blocks looked up at admission
    device: int = 0   # of those, found in the pool
    host: int = 0     # promoted from the host tier
    disk: int = 0     # promoted from the disk tier
    peer: int = 0     # fetched from a peer for this prompt

    def hits(self) -> dict[str, int]:
        """Hits by tier (``TIERS``)."""
        return {DEVICE: self.device, HOST: self.host, DISK: self.disk, PEER: self.peer}


class FetchedBlocks:
    """Hashes of blocks a peer fetch put in the pool, until an admission hits them (bounded)."""

    __slots__ = ("_hashes", "capacity")

    def __init__(self, capacity: int = FETCHED_MEMORY) -> None:
        self._hashes: OrderedDict[bytes, None] = OrderedDict()
        self.capacity = capacity

    def add(self, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def take(self, hashes: Iterable[bytes]) -> int:
        """How many of ``hashes`` were fetched and not hit yet; they are forgotten."""
        n = 0
        for h in hashes:
            if self._hashes.pop(h, False) is None:
                n += 1
        return n

    def __len__(self) -> int:
        return len(self._hashes)


def counted(by_tenant: Mapping[str, TenantLookups], tenant: str, looked_up: int, hot_hashes: Sequence[bytes],
            found: Sequence[str], fetched: FetchedBlocks) -> Mapping[str, TenantLookups]:
    """``by_tenant`` after one admission of ``tenant``: ``looked_up`` blocks, the leading
    ``hot_hashes`` found in the pool (those ``fetched`` holds are the peer's), then ``found``
    (the tier of each block promoted after them). A new mapping; the old one is left as it was."""
    if tenant == WARMUP_TENANT or not looked_up:
        return by_tenant
    peer = fetched.take(hot_hashes) if len(fetched) else 0
    was = by_tenant.get(tenant, TenantLookups())
    now = replace(was, queries=was.queries + looked_up, device=was.device + len(hot_hashes) - peer,
                  host=was.host + found.count(TIER_HOST), disk=was.disk + found.count(TIER_DISK),
                  peer=was.peer + peer)
    return {**by_tenant, tenant: now}
