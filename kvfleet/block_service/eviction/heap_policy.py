"""The mechanics the ``value``, ``fair`` and ``fair+value`` policies share: a pool's cached blocks
in buckets (one for ``value``, one per tenant for the fair ones), each bucket a min-heap of keys
with lazy deletion. A subclass says which bucket a block goes to, what it is worth, and which
bucket gives up the next victim.

A key is one int, so that the order is total and no tuple is built per block::

    key = priority << 72 | seq << 24 | block      (block < 2**24 = MAX_NUM_BLOCKS; seq < 2**48)

``seq`` counts the blocks this policy was told became cached, so among equal priorities the block
cached first goes first (a release caches its table deepest block first: a prefix goes deepest
first, as under the LRU) and no two keys are equal. ``live[b]`` is the seq of ``b``'s live key, -1
when ``b`` is not cached: a revived block only clears it, its key goes stale in place and the
eviction end skips it. A bucket whose heap holds more than twice its live keys (plus a little) is
rebuilt from them: amortised O(log n) per block cached, O(1) per block revived, O(log n + buckets)
per eviction, never O(cached blocks). Memory: ``live`` (8 bytes) and ``where`` (2 bytes) per block
of the pool, plus a heap entry (an int of 40-60 bytes and a list slot) per cached key.

Each bucket has its clock (GreedyDual's L): a victim raises it to the victim's priority, and a
block becoming cached is worth its bucket's clock plus what the subclass says it is worth; every
live key is at or above its bucket's clock, so a snapshot keeps priorities as offsets from it.
Nothing here reads a clock, a random number or a hash order: the same calls give the same victims.
"""

from __future__ import annotations

import heapq
import json
from array import array
from collections.abc import Iterator, Mapping, Sequence
from typing import ClassVar

import numpy as np

from kvfleet.block_service.eviction.policy import CachedFacts, EvictionPolicy

BLOCK_BITS, SEQ_BITS = 24, 48
SEQ_SHIFT, PRIORITY_SHIFT = BLOCK_BITS, BLOCK_BITS + SEQ_BITS
BLOCK_MASK, SEQ_MASK = (1 << BLOCK_BITS) - 1, (1 << SEQ_BITS) - 1
MAX_WORTH = (1 << 62) - 1  # a block's worth above its clock, capped: a snapshot keeps it as int64
SLACK = 64  # stale keys a bucket tolerates beyond its live ones before it is rebuilt
NONE = -1
ROW = np.dtype([("block", "<u4"), ("bucket", "<u2"), ("seq", "<i8"), ("worth", "<i8")])


class HeapPolicy(EvictionPolicy):
    """Cached blocks in buckets of lazy min-heaps; the subclass decides buckets, worth and victim."""

    __slots__ = ("num_blocks", "live", "where", "heaps", "held", "clocks", "names", "codes", "seq", "size",
                 "shares", "reason")
    needs_facts = True
    per_tenant: ClassVar[bool]  # a bucket per tenant (else one for all)
    state_keys = ("evict_rows", "evict_buckets")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.live = array("q", [NONE]) * num_blocks
        self.where = array("H", bytes(2 * num_blocks))
        self.heaps: list[list[int]] = []
        self.held: list[int] = []      # live keys per bucket
        self.clocks: list[int] = []
        self.names: list[str] = []     # bucket -> tenant ("" for the one bucket of ``value``)
        self.codes: dict[str, int] = {}
        self.seq = 0
        self.size = 0
        self.shares: dict[str, int] = {}
        self.reason = self.name
        if not self.per_tenant:
            self._bucket("")

    # ---- what a subclass decides ------------------------------------------------------------

    def worth(self, facts: CachedFacts) -> list[int]:
        """What each block of a release is worth above its bucket's clock (0: order by seq only)."""
        return [0] * len(facts.tenants)

    def choose(self, held: Sequence[int]) -> int:
        """The bucket that gives up the next victim, given the live keys per bucket (some > 0)."""
        return 0

    def reason_for(self, k: int) -> str:
        """Why bucket ``k``, chosen now, gives up a block (a metrics label)."""
        return self.name

    # ---- the policy ---------------------------------------------------------------------------

    @classmethod
    def empty(cls, num_blocks: int) -> HeapPolicy:
        return cls(num_blocks)

    def _bucket(self, tenant: str) -> int:
        k = self.codes.get(tenant)
        if k is None:
            k = self.codes[tenant] = len(self.names)
            assert k <= 0xFFFF, "a pool tells at most 65535 tenants apart"
            self.names.append(tenant)
            self.heaps.append([])
            self.held.append(0)
            self.clocks.append(0)
        return k

    def cached(self, blocks: list[int], facts: CachedFacts | None) -> None:
        assert facts is not None, "this policy needs facts"
        live, where, heaps, held, clocks = self.live, self.where, self.heaps, self.held, self.clocks
        buckets = [self._bucket(t) for t in facts.tenants] if self.per_tenant else [0] * len(blocks)
        seq = self.seq
        for b, k, w in zip(blocks, buckets, self.worth(facts)):
            seq += 1
            live[b] = seq
            where[b] = k
            heapq.heappush(heaps[k], (clocks[k] + w) << PRIORITY_SHIFT | seq << SEQ_SHIFT | b)
            held[k] += 1
        assert seq <= SEQ_MASK
        self.seq = seq
        self.size += len(blocks)

    def _gone(self, b: int) -> None:
        k = self.where[b]
        self.live[b] = NONE
        self.held[k] -= 1
        self.size -= 1
        if len(self.heaps[k]) > 2 * self.held[k] + SLACK:
            self._rebuild(k)

    def revived(self, blocks: list[int]) -> None:
        for b in blocks:
            self._gone(b)

    def discard(self, block: int) -> None:
        self._gone(block)

    def _is_live(self, key: int) -> bool:
        return self.live[key & BLOCK_MASK] == (key >> SEQ_SHIFT) & SEQ_MASK

    def _rebuild(self, k: int) -> None:
        heap = [key for key in self.heaps[k] if self._is_live(key)]
        heapq.heapify(heap)
        self.heaps[k] = heap

    def evict(self) -> int:
        k = self.choose(self.held)
        self.reason = self.reason_for(k)
        heap, live = self.heaps[k], self.live
        while True:
            key = heapq.heappop(heap)
            b = key & BLOCK_MASK
            if live[b] == (key >> SEQ_SHIFT) & SEQ_MASK:
                break
        live[b] = NONE
        self.held[k] -= 1
        self.size -= 1
        self.clocks[k] = max(self.clocks[k], key >> PRIORITY_SHIFT)
        return b

    def _sorted_live(self, k: int) -> list[int]:
        return sorted(key for key in self.heaps[k] if self._is_live(key))

    def victims(self, n: int) -> list[int]:
        """``evict``'s next ``n`` answers, by playing the choice of bucket on a copy of the counts."""
        held = list(self.held)
        order = {k: self._sorted_live(k) for k, h in enumerate(held) if h}
        taken = dict.fromkeys(order, 0)
        out: list[int] = []
        while len(out) < min(n, self.size):
            k = self.choose(held)
            out.append(order[k][taken[k]] & BLOCK_MASK)
            taken[k] += 1
            held[k] -= 1
        return out

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block: int) -> bool:
        return self.live[block] != NONE

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(np.frombuffer(self.live, dtype=np.int64) != NONE).tolist())

    def set_shares(self, shares: Mapping[str, int]) -> None:
        self.shares = dict(shares)

    # ---- snapshots ----------------------------------------------------------------------------

    def to_state(self) -> dict[str, bytes]:
        """Every live key as a row (block, bucket, seq, worth above the bucket's clock), by block;
        the buckets' tenants and clocks and the seq as JSON (clocks grow past int64 in principle)."""
        rows = []
        for k, heap in enumerate(self.heaps):
            clock = self.clocks[k]
            rows += [(key & BLOCK_MASK, k, (key >> SEQ_SHIFT) & SEQ_MASK, (key >> PRIORITY_SHIFT) - clock)
                     for key in heap if self._is_live(key)]
        rows.sort()
        table = np.array(rows, dtype=ROW) if rows else np.zeros(0, dtype=ROW)
        buckets = {"names": self.names, "clocks": [str(c) for c in self.clocks], "seq": self.seq}
        return {"evict_rows": table.tobytes(), "evict_buckets": json.dumps(buckets).encode()}

    @classmethod
    def from_state(cls, num_blocks: int, state: Mapping[str, bytes]) -> HeapPolicy:
        raw = bytes(state["evict_rows"])
        if len(raw) % ROW.itemsize:
            raise ValueError(f"a pool's eviction rows have {len(raw)} bytes, not whole rows")
        rows = np.frombuffer(raw, dtype=ROW)
        meta = json.loads(bytes(state["evict_buckets"]))
        policy = cls(num_blocks)
        for name in meta["names"]:
            if policy._bucket(name) != len(policy.names) - 1:
                raise ValueError(f"a pool's eviction buckets name {name!r} twice")
        policy.clocks = [int(c) for c in meta["clocks"]]
        policy.seq = int(meta["seq"])
        if len(policy.clocks) != len(policy.names):
            raise ValueError("a pool's eviction buckets and their clocks differ in number")
        if len(rows) and (int(rows["block"].max()) >= num_blocks or int(rows["bucket"].max()) >= len(policy.names)
                          or int(rows["seq"].min()) < 1 or int(rows["seq"].max()) > policy.seq
                          or int(rows["worth"].min()) < 0):
            raise ValueError(f"a pool's eviction rows do not fit its {num_blocks} blocks and their buckets")
        if len(np.unique(rows["block"])) != len(rows):
            raise ValueError("a block is cached twice")
        for b, k, seq, worth in rows.tolist():
            policy.live[b] = seq
            policy.where[b] = k
            policy.heaps[k].append((policy.clocks[k] + worth) << PRIORITY_SHIFT | seq << SEQ_SHIFT | b)
            policy.held[k] += 1
        for heap in policy.heaps:
            heapq.heapify(heap)
        policy.size = len(rows)
        return policy
