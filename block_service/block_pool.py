"""One node's pool of KV blocks: free list, LRU of cached blocks, prefix index, reference counts.

Every block is in exactly one of three states (DESIGN.md invariant 1)::

    state    ref   hash[b]   held in
    free     0     None      _free     stack; holds nothing
    cached   0     h         _cached   OrderedDict, least recently used first; _index[h] == b
    used     > 0   h / None  the block tables of live sequences (kept by the page table)

A used block may carry a hash without being in ``_index`` when another block already holds that
content; such a block goes back to the free list when released, since no lookup could find it.
Every operation is O(1) per block. The pool knows nothing of sequences or quotas except the tenant
charged for each used block (``owner``), which the ledger needs back when the block stops being used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvfleet.errors import FailedPrecondition, InvalidArgument

MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 2048
MAX_NUM_BLOCKS = 1 << 24


def validate_shape(num_blocks: int, block_size: int, bytes_per_block: int) -> None:
    """DESIGN.md: ``block_size`` a multiple of 16 in 16..2048; counts positive and sane."""
    if not (isinstance(num_blocks, int) and 0 < num_blocks <= MAX_NUM_BLOCKS):
        raise InvalidArgument(f"num_blocks must be in 1..{MAX_NUM_BLOCKS}, got {num_blocks!r}")
    if not (
        isinstance(block_size, int)
        and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
        and block_size % 16 == 0
    ):
        raise InvalidArgument(
            f"block_size must be a multiple of 16 in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}, got {block_size!r}"
        )
    if not (isinstance(bytes_per_block, int) and 0 < bytes_per_block < 1 << 40):
        raise InvalidArgument(f"bytes_per_block must be positive, got {bytes_per_block!r}")


class BlockPool:
    __slots__ = (
        "num_blocks", "block_size", "bytes_per_block",
        "ref", "hash", "owner", "_free", "_cached", "_index",
    )

    def __init__(self, num_blocks: int, block_size: int, bytes_per_block: int) -> None:
        validate_shape(num_blocks, block_size, bytes_per_block)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.ref = [0] * num_blocks                      # live block tables holding the block
        self.hash: list[bytes | None] = [None] * num_blocks  # set once committed
        self.owner: list[str | None] = [None] * num_blocks   # tenant charged while ref > 0
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._index: dict[bytes, int] = {}

    # ---- figures -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - len(self._cached)

    def num_available(self) -> int:
        """Blocks a fresh allocation could take: free plus evictable cached."""
        return len(self._free) + len(self._cached)

    # ---- prefix index --------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the leading ``hashes``, up to the first miss; changes nothing."""
        index = self._index
        found = []
        for h in hashes:
            b = index.get(h)
            if b is None:
                break
            found.append(b)
        return found

    def num_cached_prefix(self, hashes: Sequence[bytes]) -> int:
        index = self._index
        n = 0
        for h in hashes:
            if h not in index:
                break
            n += 1
        return n

    def num_revivable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are unreferenced (cached), i.e. would be charged when reused."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    # ---- mutators (callers check availability and quota first) ---------------------------------

    def acquire(self, blocks: Sequence[int], owner: str) -> int:
        """Reference found prefix blocks; returns how many came back from the cache (now charged)."""
        ref, cached, owners = self.ref, self._cached, self.owner
        revived = 0
        for b in blocks:
            if ref[b] == 0:
                del cached[b]
                owners[b] = owner
                revived += 1
            ref[b] += 1
        return revived

    def take(self, n: int, owner: str) -> list[int]:
        """``n`` fresh blocks: free ones first, then the least recently used cached ones (evicted)."""
        assert n <= len(self._free) + len(self._cached), "caller must check num_available()"
        free, ref, owners = self._free, self.ref, self.owner
        taken = []
        for _ in range(n):
            if free:
                b = free.pop()
            else:
                b, _ = self._cached.popitem(last=False)
                del self._index[self.hash[b]]
                self.hash[b] = None
            ref[b] = 1
            owners[b] = owner
            taken.append(b)
        return taken

    def release(self, blocks: Sequence[int], uncharged: dict[str, int]) -> None:
        """Unreference ``blocks`` in the order given; blocks reaching zero go to the cache's
        most-recently-used end if indexed, else to the free list. Adds, per tenant, the blocks
        that stopped being charged to ``uncharged``."""
        ref, hashes, owners, index, cached, free = (
            self.ref, self.hash, self.owner, self._index, self._cached, self._free,
        )
        for b in blocks:
            r = ref[b] - 1
            assert r >= 0, f"block {b} released more often than referenced"
            ref[b] = r
            if r:
                continue
            h = hashes[b]
            if h is not None and index.get(h) == b:
                cached[b] = None
            else:
                hashes[b] = None
                free.append(b)
            t = owners[b]
            owners[b] = None
            uncharged[t] = uncharged.get(t, 0) + 1

    def claim(self, tables: Sequence[tuple[Sequence[int], str]]) -> dict[str, int]:
        """Reference the blocks a node says its sequences hold (``PageTable.sync_node``), each
        ``(block_ids, owner)`` in order: a free or cached block comes into use charged to ``owner`` —
        a cached one loses its hash, since nobody knows what the node wrote in it since — and a used
        one (shared with another of the node's sequences) gains a reference. Returns, per owner, the
        blocks that came into use. One pass over the free list for all the tables."""
        ref, owners, cached, hashes = self.ref, self.owner, self._cached, self.hash
        taken_free: set[int] = set()
        charged: dict[str, int] = {}
        for blocks, owner in tables:
            for b in blocks:
                if ref[b] == 0:
                    if b in cached:
                        del cached[b]
                        del self._index[hashes[b]]
                        hashes[b] = None
                    else:
                        taken_free.add(b)
                    owners[b] = owner
                    charged[owner] = charged.get(owner, 0) + 1
                ref[b] += 1
        if taken_free:
            self._free = [b for b in self._free if b not in taken_free]
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
        self._index.setdefault(block_hash, block)
        return True

    # ---- durability and checks -----------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "shape": [self.num_blocks, self.block_size, self.bytes_per_block],
            "ref": list(self.ref),
            "hash": [h.hex() if h is not None else None for h in self.hash],
            "owner": list(self.owner),
            "free": list(self._free),
            "cached": list(self._cached),
            "index": [[h.hex(), b] for h, b in self._index.items()],
        }

    @classmethod
    def from_dict(cls, d: dict) -> BlockPool:
        pool = cls(*d["shape"])
        pool.ref = list(d["ref"])
        pool.hash = [bytes.fromhex(h) if h is not None else None for h in d["hash"]]
        pool.owner = list(d["owner"])
        pool._free = list(d["free"])
        pool._cached = OrderedDict.fromkeys(d["cached"])
        pool._index = {bytes.fromhex(h): b for h, b in d["index"]}
        return pool

    def check(self) -> None:
        """Invariant 1 and the pool's own bookkeeping; AssertionError names what broke."""
        free, cached = set(self._free), set(self._cached)
        used = {b for b in range(self.num_blocks) if self.ref[b] > 0}
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & cached and not free & used and not cached & used, "a block in two states"
        assert len(free) + len(cached) + len(used) == self.num_blocks, (
            f"free {len(free)} + cached {len(cached)} + used {len(used)} != {self.num_blocks}"
        )
        for b in free:
            assert self.hash[b] is None and self.owner[b] is None, f"free block {b} holds data"
        for b in cached:
            h = self.hash[b]
            assert h is not None and self._index.get(h) == b, f"cached block {b} is not indexed"
            assert self.owner[b] is None, f"cached block {b} is still charged"
        for b in used:
            assert self.owner[b] is not None, f"used block {b} is charged to nobody"
        for h, b in self._index.items():
            assert self.hash[b] == h, f"index names block {b} for a hash it does not hold"
