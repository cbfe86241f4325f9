"""A pool's eviction policy with pins: the cached blocks whose hash is pinned on the node are held
aside, where no policy can choose them, until their pin ends (``kvfleet.block_service.pins``).

The wrapper stands between the pool and its policy (``install``, once the node has a pin) and
passes every call through, except that a block becoming cached with a pinned hash is held instead of
handed to the policy, and ``evictable`` (what an allocation may evict) leaves the held blocks out.
A held block is still cached (the pool's invariant 1 counts it so); a prefix hit revives it as
usual. When its pin ends it goes to the policy as if it had just become cached: its tenant (the
pool's owner of a cached block), its hits (the pool's facts) and the prefill the pin said it saves
(``Pin.cost``), at the pool's tick — all durable, so the live table, a replayed log and a restored
snapshot hand the policy the same calls.

Nothing of the held set is in a snapshot: it is exactly the cached blocks whose hash is pinned,
found again from the pool and the pins when a snapshot is restored (``restore``); ``to_state`` is
the policy's own, without them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from kvfleet.block_service.eviction.policy import CachedFacts, EvictionPolicy

if TYPE_CHECKING:
    from kvfleet.block_service.block_pool import BlockPool


class PinnedPolicy(EvictionPolicy):
    __slots__ = ("inner", "pool", "pinned", "held")

    def __init__(self, pool: BlockPool, inner: EvictionPolicy, pinned: Mapping[bytes, object]) -> None:
        self.inner, self.pool, self.pinned = inner, pool, pinned  # pinned: the node's pins by hash
        self.held: set[int] = set()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def state_keys(self) -> tuple[str, ...]:  # type: ignore[override]
        return self.inner.state_keys

    @property
    def reason(self) -> str:
        return self.inner.reason

    @property
    def evictable(self) -> int:
        return len(self.inner)

    def cached(self, blocks: list[int], facts: CachedFacts | None) -> None:
        if self.pinned:
            hashes, pinned = self.pool.hash, self.pinned
            keep = [hashes[b] not in pinned for b in blocks]
            if not all(keep):
                self.held.update(b for b, k in zip(blocks, keep) if not k)
                blocks = [b for b, k in zip(blocks, keep) if k]
                if facts is not None:
                    facts = CachedFacts(*([x for x, k in zip(xs, keep) if k]
                                          for xs in (facts.tenants, facts.hits, facts.costs)), facts.tick)
                if not blocks:
                    return
        self.inner.cached(blocks, facts)

    def revived(self, blocks: list[int]) -> None:
        held = self.held
        if held and not held.isdisjoint(blocks):
            rest = [b for b in blocks if b not in held]
            held.difference_update(blocks)
            blocks = rest
        self.inner.revived(blocks)

    def discard(self, block: int) -> None:
        if block in self.held:
            self.held.remove(block)
        else:
            self.inner.discard(block)

    def evict(self) -> int:
        return self.inner.evict()

    def victims(self, n: int) -> list[int]:
        return self.inner.victims(n)

    def __len__(self) -> int:
        return len(self.inner) + len(self.held)

    def __contains__(self, block: int) -> bool:
        return block in self.held or block in self.inner

    def __iter__(self) -> Iterator[int]:
        yield from self.inner
        yield from sorted(self.held)

    def set_shares(self, shares: Mapping[str, int]) -> None:
        self.inner.set_shares(shares)

    def to_state(self) -> dict[str, bytes]:
        return self.inner.to_state()

    @classmethod
    def from_state(cls, num_blocks: int, state: Mapping[str, bytes]) -> EvictionPolicy:
        raise TypeError("a pinned policy is installed over a pool's own (install), never built by name")

    @classmethod
    def empty(cls, num_blocks: int) -> EvictionPolicy:
        raise TypeError("a pinned policy is installed over a pool's own (install), never built by name")

    # ---- pins beginning and ending -------------------------------------------------------------

    def hold(self, block: int) -> None:
        """A cached block's hash was just pinned: out of the policy's reach."""
        if block not in self.held:
            self.inner.discard(block)
            self.held.add(block)

    def unhold(self, block: int, cost: int) -> None:
        """A held block's pin ended: to the policy, as if it had just become cached."""
        self.held.remove(block)
        pool, facts = self.pool, self.pool._facts
        told = None
        if facts is not None:
            owner = pool._owners[pool._owner[block]] or ""
            told = CachedFacts([owner], [facts.hits[block]], [cost], facts.tick)
        self.inner.cached([block], told)


def install(pool: BlockPool, pinned: Mapping[bytes, object]) -> PinnedPolicy:
    """The pool's policy with pins (installed once; the same wrapper after)."""
    policy = pool._policy
    if not isinstance(policy, PinnedPolicy):
        policy = pool._policy = PinnedPolicy(pool, policy, pinned)
    return policy


def restore(pool: BlockPool, pinned: Mapping[bytes, object]) -> None:
    """A restored pool (its hashes indexed): hold its cached blocks whose hash is pinned — the
    snapshot's policy state left them out, as the live policy did."""
    policy = install(pool, pinned)
    for h in pinned:
        b = pool._index.block(h, pool.slot)
        if b is not None and pool.ref[b] == 0:
            policy.held.add(b)
