"""One node's pool of KV blocks: free list, cached blocks in its eviction policy's order, its part of
the prefix index, reference counts.

Every block is in exactly one of three states (docs/design.md invariant 1)::

    state    ref   hash[b]   held in                                                            owner
    free     0     None      _free     stack; holds nothing                                     nobody
    cached   0     h         _policy   the next victim first (``eviction``); the index maps     the last one charged
                                       (h, this node) to b                                      (evictions' label)
    used     > 0   h / None  the block tables of live sequences (kept by the page table)      the one charged

A used block may carry a hash without being indexed when another block of the node already holds
that content; such a block goes back to the free list when released, since no lookup could find it.
Every operation is O(1) per block. The pool knows nothing of sequences or quotas except the tenant
charged for each used block (its owner), which the ledger needs back when the block stops being used.

Sized for a fleet (1,000 nodes x 100,000 blocks in one process): per block, a reference
count (a list slot, 8 bytes: read on every path, and the counts are small shared ints), an owner
code (uint16, into the pool's short list of tenant names), a slot in the hash list (8 bytes; the
hash object only once committed), the eviction policy's own (LRU: a position, int32, plus a queue
entry or two per cached block, ``BlockLru``), an "indexed" flag (1 byte) and, when free, a uint32 in the free stack — ~27
bytes instead of ~64 for lists of Python objects; and the
prefix index is the page table's one ``PrefixIndex`` for every node (this pool is ``slot`` there),
not a dict per pool.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter

import numpy as np

from kvfleet.block_service.eviction import DEFAULT_POLICY, EvictionPolicy, policy_class
from kvfleet.block_service.eviction.facts import BlockFacts
from kvfleet.block_service.prefix_index import PrefixIndex
from kvfleet.core.block_hash import HASH_BYTES
from kvfleet.core.block_size import check_block_size
from kvfleet.core.errors import FailedPrecondition, InvalidArgument

MAX_NUM_BLOCKS = 1 << 24
MAX_OWNERS = 0xFFFF  # tenants a pool can tell apart (codes are uint16; 0 is nobody)


def validate_shape(num_blocks: int, block_size: int, bytes_per_block: int) -> None:
    """``block_size`` by the fleet's rule (``kvfleet.core.block_size``); counts positive and sane."""
    if not (isinstance(num_blocks, int) and 0 < num_blocks <= MAX_NUM_BLOCKS):
        raise InvalidArgument(f"num_blocks must be in 1..{MAX_NUM_BLOCKS}, got {num_blocks!r}")
    check_block_size(block_size)
    if not (isinstance(bytes_per_block, int) and 0 < bytes_per_block < 1 << 40):
        raise InvalidArgument(f"bytes_per_block must be positive, got {bytes_per_block!r}")


@dataclass(slots=True)
class PoolState:
    """A pool's whole state as flat arrays, for snapshots (``pool_codec``). ``unindexed``: the
    blocks that carry a hash the node indexes at another block; ``eviction``: the policy's own
    state (``EvictionPolicy.to_state``); ``facts``: what the pool keeps for it, if it asks."""

    shape: tuple[int, int, int]
    ref: array | list      # per block (uint32 in a snapshot)
    owner: array           # uint16 per block: 0 nobody, else owners[code - 1]
    owners: list[str]
    hashed: np.ndarray     # uint32, the blocks holding a hash, ascending
    hashes: bytes          # their hashes, HASH_BYTES each, in that order
    free: array            # uint32, the stack (the next block handed out last)
    unindexed: list[int]
    eviction: dict         # the policy's state, keyed by its ``state_keys``
    facts: dict | None = None


class BlockPool:
    __slots__ = (
        "num_blocks", "block_size", "bytes_per_block", "slot",
        "ref", "hash", "_owner", "_owners", "_codes", "_free", "_policy", "_facts", "_index",
        "_indexed", "_evicted",
    )

    def __init__(self, num_blocks: int, block_size: int, bytes_per_block: int,
                 index: PrefixIndex | None = None, slot: int = 0, eviction: str = DEFAULT_POLICY) -> None:
        validate_shape(num_blocks, block_size, bytes_per_block)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.slot = slot                                   # this pool's node in the index
        self.ref = [0] * num_blocks  # live block tables holding the block (a list: read on every path)
        self.hash: list[bytes | None] = [None] * num_blocks  # set once committed
        self._owner = array("H", bytes(2 * num_blocks))     # tenant charged while ref > 0 (a code)
        self._owners: list[str | None] = [None]             # code → tenant
        self._codes: dict[str, int] = {}                    # tenant → code
        self._free = array("I", range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        policy = policy_class(eviction)
        self._policy: EvictionPolicy = policy.empty(num_blocks)
        self._facts = BlockFacts(num_blocks) if policy.needs_facts else None
        self._index = index if index is not None else PrefixIndex()
        self._indexed = bytearray(num_blocks)  # 1 where the index names this block for its hash
        self._evicted: dict[tuple[int, str], int] = {}  # (owner code, reason) -> evictions since start

    # ---- figures -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._policy)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._policy)

    def num_available(self) -> int:
        """Blocks a fresh allocation could take: free plus evictable cached."""
        return len(self._free) + self._policy.evictable

    @property
    def eviction(self) -> str:
        """The name of the pool's eviction policy."""
        return self._policy.name

    def next_victims(self, n: int) -> list[int]:
        """The cached blocks the next ``take`` past the free list would evict, in order."""
        return self._policy.victims(n)

    def set_shares(self, shares: dict[str, int]) -> None:
        """Each limited tenant's quota here in blocks, for the policy (``EvictionPolicy.set_shares``)."""
        self._policy.set_shares(shares)

    def owner(self, block: int) -> str | None:
        """The tenant charged for ``block`` (None unless it is used)."""
        return self._owners[self._owner[block]] if self.ref[block] else None

    def charged(self) -> dict[str, int]:
        """Used blocks per tenant charged."""
        per: dict[str, int] = {}
        owners = self._owners
        for code, r in zip(self._owner, self.ref):
            if r:
                t = owners[code]
                per[t] = per.get(t, 0) + 1
        return per

    def evictions(self) -> dict[str, dict[str, int]]:
        """Cached blocks evicted since start, per tenant last charged ("": not known, cached before a
        restore from an older snapshot) and the policy's reason (not durable, like every counter)."""
        per: dict[str, dict[str, int]] = {}
        for (code, reason), n in sorted(self._evicted.items()):
            by = per.setdefault(self._owners[code] or "", {})
            by[reason] = by.get(reason, 0) + n
        return per

    # ---- prefix index --------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the leading ``hashes``, up to the first miss; changes nothing."""
        return self._index.lookup(hashes, self.slot)

    def num_revivable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are unreferenced (cached), i.e. would be charged when reused."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    # ---- mutators (callers check availability and quota first) ---------------------------------

    def _code(self, owner: str) -> int:
        code = self._codes.get(owner)
        if code is None:
            code = len(self._owners)
            if code > MAX_OWNERS:
                raise FailedPrecondition(f"a pool tells at most {MAX_OWNERS} tenants apart")
            self._codes[owner] = code
            self._owners.append(owner)
        return code

    def acquire(self, blocks: Sequence[int], owner: str) -> int:
        """Reference found prefix blocks; returns how many came back from the cache (now charged)."""
        ref, owners = self.ref, self._owner
        revived = [b for b in blocks if ref[b] == 0]  # distinct blocks: one per hash
        if revived:
            code = self._code(owner)  # (before any change: it may refuse)
            self._policy.revived(revived)
            for b in revived:
                owners[b] = code
        for b in blocks:
            ref[b] += 1
        if self._facts is not None:
            self._facts.hit(blocks)
        return len(revived)

    def take(self, n: int, owner: str) -> list[int]:
        """``n`` fresh blocks: free ones first, then cached ones, evicted in the policy's order."""
        free, ref, owners = self._free, self.ref, self._owner
        num_free = len(free)
        assert n <= num_free + self._policy.evictable, "caller must check num_available()"
        if n <= 0:
            return []
        code = self._codes.get(owner) or self._code(owner)
        if n <= num_free:
            if n == 1:
                taken = [free.pop()]
            else:
                taken = free[num_free - n:].tolist()
                taken.reverse()
                del free[num_free - n:]
        else:
            taken = []
            if num_free:
                taken = free.tolist()
                taken.reverse()
                del free[:]
            policy, index, hashes, indexed, slot, evicted = (
                self._policy, self._index, self.hash, self._indexed, self.slot, self._evicted)
            for _ in range(n - num_free):
                b = policy.evict()
                index.remove(hashes[b], slot)
                hashes[b] = None
                indexed[b] = 0
                taken.append(b)
                why = (owners[b], policy.reason)
                evicted[why] = evicted.get(why, 0) + 1
        for b in taken:
            ref[b] = 1
            owners[b] = code
        if self._facts is not None:
            self._facts.renew(taken)
        return taken

    def release(self, blocks: Sequence[int], uncharged: dict[str, int], depth: int = 0) -> None:
        """Unreference ``blocks`` (a table's, deepest first, the first at position ``depth - 1``);
        those reaching zero go to the policy in that order if indexed, else to the free list. Adds,
        per tenant, the blocks that stopped being charged to ``uncharged``."""
        ref, hashes, owners, indexed, free, names, facts = (
            self.ref, self.hash, self._owner, self._indexed, self._free, self._owners, self._facts,
        )
        tenants = [names[owners[b]] for b in blocks] if facts is not None else ()
        cached = []
        for b in blocks:
            r = ref[b] - 1
            assert r >= 0, f"block {b} released more often than referenced"
            ref[b] = r
            if r:
                continue
            t = names[owners[b]]
            if indexed[b]:
                cached.append(b)  # (its owner stays: the tenant an eviction of it is counted for)
            else:
                hashes[b] = None
                free.append(b)
                owners[b] = 0
            uncharged[t] = uncharged.get(t, 0) + 1
        if cached:
            self._policy.cached(cached, facts.cached(cached, blocks, tenants, depth, self.block_size)
                                if facts is not None else None)

    def claim(self, tables: Sequence[tuple[Sequence[int], str]]) -> dict[str, int]:
        """Reference the blocks a node says its sequences hold (``PageTable.sync_node``), each
        ``(block_ids, owner)`` in order: a free or cached block comes into use charged to ``owner`` —
        a cached one loses its hash, since nobody knows what the node wrote in it since — and a used
        one (shared with another of the node's sequences) gains a reference. Returns, per owner, the
        blocks that came into use. One pass over the free list for all the tables."""
        ref, owners, policy, hashes = self.ref, self._owner, self._policy, self.hash
        taken_free: set[int] = set()
        charged: dict[str, int] = {}
        codes = [self._code(owner) for _, owner in tables]  # before any change: it may refuse
        for (blocks, owner), code in zip(tables, codes):
            for b in blocks:
                if ref[b] == 0:
                    if hashes[b] is not None:  # unreferenced with a hash: cached
                        policy.discard(b)
                        self._index.remove(hashes[b], self.slot)
                        hashes[b] = None
                        self._indexed[b] = 0
                    else:
                        taken_free.add(b)
                    owners[b] = code
                    charged[owner] = charged.get(owner, 0) + 1
                    if self._facts is not None:
                        self._facts.renew((b,))
                ref[b] += 1
        if taken_free:
            self._free = array("I", [b for b in self._free if b not in taken_free])
        return charged

    def commit(self, block: int, block_hash: bytes) -> bool:
        """Name a used block's content; returns False when it already had that name."""
        assert self.ref[block] > 0, f"commit of unreferenced block {block}"
        old = self.hash[block]
        if old == block_hash:
            return False
        if old is not None:
            raise FailedPrecondition(
                f"block {block} is already committed with hash {old.hex()}, not {block_hash.hex()}"
            )
        self.hash[block] = block_hash
        if self._index.add(block_hash, self.slot, block):  # unless another block of this node has it
            self._indexed[block] = 1
        return True

    def unindex_all(self) -> None:
        """Take this pool's hashes out of the shared index (the node is going away)."""
        index, slot, hashes = self._index, self.slot, self.hash
        for b in compress(range(self.num_blocks), self._indexed):
            index.remove(hashes[b], slot)

    # ---- durability and checks -----------------------------------------------------------------

    def state(self) -> PoolState:
        """The pool's arrays as they are (``ref``, ``owner`` and ``free`` are not copies: encode
        them before changing the pool). Found by C loops and numpy, not a statement per block."""
        indexed = np.frombuffer(self._indexed, dtype=np.uint8)
        if self.num_blocks - self.hash.count(None) == self._indexed.count(1):
            unindexed = []  # the usual case: the hashed blocks are the indexed ones
            hashed = np.flatnonzero(indexed).astype(np.uint32)
        else:
            hashed = np.array(list(compress(range(self.num_blocks), self.hash)), dtype=np.uint32)
            unindexed = [b for b in hashed.tolist() if not self._indexed[b]]
        del indexed
        hashes = b"".join(itemgetter(*hashed.tolist())(self.hash)) if len(hashed) > 1 else (
            self.hash[int(hashed[0])] if len(hashed) else b"")
        return PoolState((self.num_blocks, self.block_size, self.bytes_per_block), self.ref, self._owner,
                         self._owners[1:], hashed, hashes, self._free, unindexed, self._policy.to_state(),
                         self._facts.to_state() if self._facts is not None else None)

    @classmethod
    def from_state(cls, s: PoolState, index: PrefixIndex | None = None, slot: int = 0,
                   eviction: str = DEFAULT_POLICY) -> BlockPool:
        """The pool ``state()`` described under the policy ``eviction``, its hashes (all but ``unindexed``) staged in ``index``
        (``PrefixIndex.settle`` indexes them: once for all the pools of a page table).
        Raises ValueError when the arrays do not fit together (a block outside the pool, hashes
        and their blocks differing in number)."""
        validate_shape(*s.shape)
        n = s.shape[0]
        hashed = np.asarray(s.hashed, dtype=np.int64)
        if len(s.hashes) != HASH_BYTES * len(hashed):
            raise ValueError(f"a pool's hashes and their blocks differ in number ({len(s.hashes)} bytes, "
                             f"{len(hashed)} blocks)")
        if len(hashed) and (int(hashed.min()) < 0 or int(hashed.max()) >= n):
            raise ValueError(f"a hashed block is outside the pool of {n} blocks")
        if len(s.ref) != n or len(s.owner) != n or any(not 0 <= b < n for b in s.unindexed):
            raise ValueError(f"a pool's per-block arrays do not have its {n} blocks")
        pool = cls.__new__(cls)  # not __init__: its fresh arrays would be thrown away
        pool.num_blocks, pool.block_size, pool.bytes_per_block = s.shape
        pool.slot, pool._index = slot, index if index is not None else PrefixIndex()
        pool.ref, pool._owner, pool._free = list(s.ref), s.owner, s.free
        pool._owners = [None, *s.owners]
        pool._codes = {t: i for i, t in enumerate(pool._owners) if i}
        policy = policy_class(eviction)
        pool._policy, pool._facts, pool._evicted = policy.from_state(n, s.eviction), None, {}
        if policy.needs_facts:
            pool._facts = BlockFacts.from_state(n, s.facts) if s.facts is not None else BlockFacts(n)
        chunks = np.frombuffer(s.hashes, dtype=f"V{HASH_BYTES}").tolist()  # bytes objects, made in C
        column = np.empty(n, dtype=object)  # None everywhere
        column[hashed] = chunks
        pool.hash = column.tolist()
        flags = np.zeros(n, dtype=np.uint8)
        flags[hashed] = 1
        blocks, blob = hashed, s.hashes
        if s.unindexed:
            flags[np.asarray(s.unindexed, dtype=np.int64)] = 0
            keep = flags[hashed].astype(bool)
            blocks, blob = hashed[keep], np.frombuffer(s.hashes, dtype=f"V{HASH_BYTES}")[keep].tobytes()
        pool._indexed = bytearray(flags.tobytes())
        pool._index.stage(slot, blob, blocks)  # indexed by the caller's ``settle`` (all pools at once)
        if index is None:
            pool._index.settle()
        return pool

    def check(self) -> int:
        """Invariant 1 and the pool's own bookkeeping; AssertionError names what broke. Returns
        how many hashes the pool indexes (the page table checks the index holds no others)."""
        free, cached = set(self._free), set(self._policy)
        used = {b for b in range(self.num_blocks) if self.ref[b] > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert len(cached) == len(self._policy), "the eviction policy's size is not its length"
        assert all(b in self._policy for b in cached), "the eviction policy misses a block it lists"
        assert not free & cached and not free & used and not cached & used, "a block in two states"
        assert len(free) + len(cached) + len(used) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + used {len(used)} != {self.num_blocks}"
        )
        index, slot = self._index, self.slot
        for b in free:
            assert self.hash[b] is None and not self._owner[b], f"free block {b} holds data"
        for b in cached:
            h = self.hash[b]
            assert h is not None and index.block(h, slot) == b, f"cached block {b} is not indexed"
        for b in used:
            assert self.owner(b) is not None, f"used block {b} is charged to nobody"
        indexed = 0
        for b, h in enumerate(self.hash):
            if h is not None:  # a used duplicate's hash may be indexed nowhere (its twin was evicted)
                found = index.block(h, slot)
                assert found is None or self.hash[found] == h, f"index names block {found} for a hash it does not hold"
                assert self._indexed[b] == (found == b), f"block {b}: its indexed flag is wrong"
                indexed += found == b
        return indexed
