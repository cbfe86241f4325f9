"""The interface every eviction policy implements, and the facts a pool hands to one.

The pool (``BlockPool``) owns the free/cached/used states; a policy only orders the *cached* set,
the blocks no table holds whose content the prefix index still finds. The pool tells it::

    cached(blocks, facts)   these blocks became cached, in this order (a release: deepest first)
    revived(blocks)         a prefix hit took them back into use: they leave the cached set
    discard(block)          it left the cached set without a hit (a node's sync claimed it)
    evict()                 the pool needs a block: take the next victim out and name it
    reason                  why that victim went (a metrics label: ``lru``, ``value``, ``over_share``...)

and ``set_shares`` tells it each tenant's share of the node's cached blocks (``cache_share_mib``,
else ``reserved_mib``: ``kvfleet.core.tenants.Tenant.cache_share_blocks``). A policy that sets
``needs_facts`` is handed, per block becoming cached, its tenant, its prefix hits, the prefill
tokens a hit reaching it saves and the pool's tick (``CachedFacts``); LRU needs none of it and the
pool then keeps no facts at all.

Replay depends on it: a policy is a pure function of the calls it was told about, with no wall
clock, no randomness and no iteration over a hash order, its ties broken by a stable key (the block
id, or the order blocks became cached), so that replaying the write-ahead log, or restoring a
snapshot (``to_state`` / ``from_state``), evicts exactly the blocks the live table evicted. The
name of the policy is part of the durable state (``PageTable.to_dict``); recovery refuses a state
written under another policy (``recovery``) rather than evict differently from the table that wrote it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar


@dataclass(slots=True)
class CachedFacts:
    """What the pool knows of blocks that just became cached, each list parallel to the blocks."""

    tenants: list[str]  # the tenant charged for the block until now
    hits: list[int]     # prefix hits on it since its content was written
    costs: list[int]    # prefill tokens a hit reaching it saves: its position in the table + 1, in tokens
    tick: int           # the pool's logical clock (one tick per release): when they became cached


class EvictionPolicy(ABC):
    """The cached blocks of one pool, ordered by what to evict first."""

    __slots__ = ()
    name: ClassVar[str]
    needs_facts: ClassVar[bool] = False
    state_keys: ClassVar[tuple[str, ...]]  # the keys of ``to_state`` (snapshot fields of the pool)

    @abstractmethod
    def cached(self, blocks: list[int], facts: CachedFacts | None) -> None:
        """``blocks`` (distinct, none cached) became cached, in this order; ``facts`` is None
        unless ``needs_facts``."""

    @abstractmethod
    def revived(self, blocks: list[int]) -> None:
        """``blocks`` (distinct, all cached) were hit by a prefix lookup and are in use again."""

    @abstractmethod
    def discard(self, block: int) -> None:
        """``block`` (cached) left the cached set without a hit: its content is gone."""

    @abstractmethod
    def evict(self) -> int:
        """Take the next victim out of the cached set (not empty) and return it."""

    @property
    def reason(self) -> str:
        """Why the block ``evict`` last returned went (a metrics label, from a short fixed set):
        the policy's name unless it says more."""
        return self.name

    @property
    def evictable(self) -> int:
        """How many cached blocks ``evict`` may still return (all of them, unless pins hold some)."""
        return len(self)

    @abstractmethod
    def victims(self, n: int) -> list[int]:
        """The next ``n`` blocks ``evict`` would return, in order; changes nothing."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    @abstractmethod
    def __iter__(self) -> Iterator[int]:
        """The cached blocks (eviction order where the policy keeps one)."""

    def set_shares(self, shares: Mapping[str, int]) -> None:
        """Each tenant's share of this pool's cached blocks, in blocks (tenants without one are
        absent); told again on every change of the tenants' configuration. Not part of
        ``to_state``: the page table tells a restored policy its shares again."""

    @abstractmethod
    def to_state(self) -> dict[str, bytes]:
        """The policy's whole state, keyed by ``state_keys``, for a snapshot."""

    @classmethod
    @abstractmethod
    def from_state(cls, num_blocks: int, state: Mapping[str, bytes]) -> EvictionPolicy:
        """The policy ``to_state`` described; ValueError when the state does not fit the pool."""

    @classmethod
    @abstractmethod
    def empty(cls, num_blocks: int) -> EvictionPolicy:
        """A policy for a fresh pool of ``num_blocks`` blocks, nothing cached."""
