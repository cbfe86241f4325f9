"""The part of the prefix index a recovery loads: hashes held by exactly one node, as sorted numpy
arrays instead of dict entries.

A fleet's snapshot holds ~20 M (hash, node) pairs at 1,000 nodes x 100,000 blocks (20% cached),
nearly all of them private suffixes held by one node. Putting each in a dict costs a key object, a
value object and a table slot (~10 s of CPU and ~1.5 GB at that size); sorting their first eight
bytes with numpy costs ~2 s and 25 bytes a key. So recovery keeps them here, and the index
(``PrefixIndex``) moves a key into its dict the first time anything reads or changes it
(``take``): what the fleet uses again comes back into the dict as it is used, the rest leaves
with evictions. Keys are random digests, so their first eight bytes (``hi``) tell them apart; the
few keys that agree in the top bits of ``hi`` are never put here (``split_runs``).

A lookup of a key that is not here must be cheap (every commit asks): a bitmap over the top bits
of ``hi`` answers most of them from a ``bytearray`` before any numpy call.
"""

from __future__ import annotations

import numpy as np

MAX_FILTER_BITS = 28  # at most a 32 MiB bitmap: ~7% false positives at 18 M keys


def split_runs(hi: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(order, starts, lengths)``: ``hi[order]`` sorted and cut into runs that agree in their top
    ``64 - b`` bits (``b`` the bits of ``len(hi) - 1``). One ``np.sort`` of ``hi`` with the low bits
    replaced by each value's position (~3x cheaper than ``argsort``): a run of one is a value no
    other shares the top bits of, so those come out strictly ascending; longer runs (the same hash
    from several nodes, or a rare near miss) are the caller's to tell apart."""
    if len(hi) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    bits = np.uint64(max(1, (len(hi) - 1).bit_length()))
    packed = np.sort((hi >> bits << bits) | np.arange(len(hi), dtype=np.uint64))
    order = (packed & ((np.uint64(1) << bits) - np.uint64(1))).astype(np.int64)
    top = packed >> bits
    starts = np.flatnonzero(np.concatenate(([True], top[1:] != top[:-1])))
    return order, starts, np.diff(np.append(starts, len(hi)))


class FrozenKeys:
    """Sorted unique ``hi`` with each key's ``lo`` and index value; ``gone`` marks keys taken."""

    __slots__ = ("hi", "lo", "value", "gone", "live", "_filter", "_shift")

    def __init__(self, hi: np.ndarray, lo: np.ndarray, value: np.ndarray) -> None:
        """``hi`` sorted, unique (uint64); ``lo`` (uint64) and ``value`` (int64) alike."""
        self.hi, self.lo, self.value = hi, lo, value
        self.gone = np.zeros(len(hi), dtype=bool)
        self.live = len(hi)
        bits = min(MAX_FILTER_BITS, max(10, (16 * len(hi)).bit_length()))  # ~16 bits a key
        self._shift = 64 - bits
        top = (hi >> np.uint64(self._shift)).astype(np.int64)  # sorted, as hi is
        byte, bit = top >> 3, np.left_shift(1, top & 7).astype(np.uint8)
        starts = np.flatnonzero(np.concatenate(([True], byte[1:] != byte[:-1]))) if len(hi) else byte
        table = np.zeros(1 << (bits - 3), dtype=np.uint8)
        if len(hi):
            table[byte[starts]] = np.bitwise_or.reduceat(bit, starts)
        self._filter = bytearray(table.tobytes())

    def find(self, h: bytes) -> int:
        """The position of ``h`` if it is here and not taken, else -1."""
        x = int.from_bytes(h[:8], "little")
        f = x >> self._shift
        if not (self._filter[f >> 3] >> (f & 7)) & 1:
            return -1
        i = int(np.searchsorted(self.hi, np.uint64(x)))
        if i < len(self.hi) and int(self.hi[i]) == x and int(self.lo[i]) == int.from_bytes(h[8:], "little") \
                and not self.gone[i]:
            return i
        return -1

    def find_many(self, hashes: list[bytes]) -> list[int]:
        """``find`` of each of ``hashes`` in one numpy pass (a prompt's worth after a recovery:
        ~3 us a key one by one, a few us for them all)."""
        q = np.frombuffer(b"".join(hashes), dtype="<u8").reshape(-1, 2)
        at = np.searchsorted(self.hi, q[:, 0])
        i = np.minimum(at, len(self.hi) - 1)
        ok = (at < len(self.hi)) & (self.hi[i] == q[:, 0]) & (self.lo[i] == q[:, 1]) & ~self.gone[i]
        return np.where(ok, i, -1).tolist()

    def take(self, i: int) -> int:
        """Mark key ``i`` gone (it moves to the dict, or its holder dropped it); its value."""
        self.gone[i] = True
        self.live -= 1
        return int(self.value[i])

    def keys(self) -> list[bytes]:
        """The keys not taken (for checks and iteration; not a hot path)."""
        keep = ~self.gone
        both = np.empty((int(keep.sum()), 2), dtype="<u8")
        both[:, 0], both[:, 1] = self.hi[keep], self.lo[keep]
        return np.frombuffer(both.tobytes(), dtype="V16").tolist()

    def items(self) -> list[tuple[bytes, int]]:
        return list(zip(self.keys(), self.value[~self.gone].tolist()))
