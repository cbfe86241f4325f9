"""The fleet's prefix index: block hash → the nodes whose pools index it, and the block there.

One dict for every node instead of one per node, so that ``match_prefix`` walks a prompt once for
the whole fleet instead of once per node: at each depth the set of nodes still matching is ANDed
with the hash's holders, kept as a bitset (a Python int, bit ``slot`` for the node in that slot);
its cost grows with the prompt's length, not with the number of nodes holding it. A node is a
small integer ``slot`` given by the page table.

An entry is, to keep the common case small (a private block held by one node):

    int                    (block << SLOT_BITS) | slot          one holder
    Shared {slot: block}   .mask = OR of 1 << slot              two or more holders

A node indexes a hash at most once (the first block committed with it; ``add`` is a setdefault
per node), exactly as the per-node dict it replaces did. The pools keep it exactly in step: a
commit adds, an eviction, a claim (node sync) or a node's removal removes.

Recovery (``stage`` each pool's indexed hashes, then ``settle``) puts the hashes shared by several
nodes in the dict and those held by one node in ``FrozenKeys`` (sorted numpy arrays: a dict of
20 M entries alone took ~10 s of CPU to build); a key leaves them for the dict the first time any
call reads or changes it, so every method below first looks in the dict, then there.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvfleet.block_service.frozen_keys import FrozenKeys, split_runs

SLOT_BITS = 20                  # up to a million nodes per page table
SLOT_MASK = (1 << SLOT_BITS) - 1
MAX_SLOTS = 1 << SLOT_BITS


class Shared(dict):
    """``{slot: block}`` of a hash two or more nodes name, with their bitset."""

    __slots__ = ("mask",)


_NOBODY = Shared()  # what a lookup of an unknown hash finds: nobody's block


class PrefixIndex:
    __slots__ = ("_entries", "_pairs", "_frozen", "_staged")

    def __init__(self) -> None:
        self._entries: dict[bytes, int | Shared] = {}
        self._pairs = 0  # (hash, slot) pairs: what the pools' check counts against
        self._frozen: FrozenKeys | None = None  # single holders loaded by a recovery, not yet used
        self._staged: list[tuple[int, bytes, np.ndarray]] = []

    def __len__(self) -> int:
        """Distinct hashes indexed by at least one node."""
        return len(self._entries) + (self._frozen.live if self._frozen is not None else 0)

    def _thaw(self, h: bytes) -> int | Shared | None:
        """``h``'s entry, moved into the dict from the recovered keys if it is there."""
        frozen = self._frozen
        if frozen is None:
            return None
        i = frozen.find(h)
        if i < 0:
            return None
        e = self._entries[h] = frozen.take(i)
        if not frozen.live:
            self._frozen = None
        return e

    @property
    def num_pairs(self) -> int:
        """(hash, node) pairs indexed."""
        return self._pairs

    def block(self, h: bytes, slot: int) -> int | None:
        """The block indexed for ``h`` on the node in ``slot``, or None."""
        e = self._entries.get(h)
        if e is None:
            e = self._thaw(h)
            if e is None:
                return None
        if type(e) is int:
            return e >> SLOT_BITS if e & SLOT_MASK == slot else None
        return e.get(slot)

    def lookup(self, hashes: Sequence[bytes], slot: int) -> list[int]:
        """Blocks of the node in ``slot`` holding the leading ``hashes``, up to the first miss.
        (The dict lookups run in C, ``map``; this is on every allocation's path.)"""
        if self._frozen is not None:
            self._thaw_leading(hashes)
        found = []
        append = found.append
        for e in map(self._entries.get, hashes):
            if e.__class__ is Shared:  # the common hit: a shared prefix
                b = e.get(slot)
                if b is None:
                    break
                append(b)
            elif e is None or e & SLOT_MASK != slot:
                break
            else:
                append(e >> SLOT_BITS)
        return found

    def _thaw_leading(self, hashes: Sequence[bytes], past_misses: bool = False) -> None:
        """Move the leading ``hashes`` the recovered keys hold into the dict, up to the first that
        neither holds (where a lookup or a match stops), or all of them (``past_misses``)."""
        entries, frozen = self._entries, self._frozen
        missing = [h for h in hashes if h not in entries]
        if not missing:
            return
        for h, i in zip(missing, frozen.find_many(missing) if len(missing) > 2 else map(frozen.find, missing)):
            if h in entries:  # the prompt holds it twice
                continue
            if i < 0:
                if past_misses:
                    continue
                break
            entries[h] = frozen.take(i)
        if not frozen.live:
            self._frozen = None

    def holders(self, h: bytes) -> dict[int, int]:
        """``{slot: block}`` of every node indexing ``h``."""
        e = self._entries.get(h)
        if e is None:
            e = self._thaw(h)
            if e is None:
                return {}
        if type(e) is int:
            return {e & SLOT_MASK: e >> SLOT_BITS}
        return dict(e)

    def __iter__(self) -> Iterator[bytes]:
        yield from list(self._entries)
        if self._frozen is not None:
            yield from self._frozen.keys()

    # ---- changes (the pools call these, in step with their blocks) ------------------------------

    def add(self, h: bytes, slot: int, block: int) -> bool:
        """Index ``h`` at ``block`` for the node in ``slot`` unless that node already indexes ``h``;
        True if added."""
        entries = self._entries
        v = (block << SLOT_BITS) | slot
        e = entries.setdefault(h, v)
        if e is v:  # new to the dict: one dict operation, the common case
            if self._frozen is None or (old := self._thaw(h)) is None:
                self._pairs += 1
                return True
            e = old
        if type(e) is int:
            other = e & SLOT_MASK
            if other == slot:
                return False
            shared = entries[h] = Shared({other: e >> SLOT_BITS, slot: block})
            shared.mask = (1 << other) | (1 << slot)
        else:
            if slot in e:
                return False
            e[slot] = block
            e.mask |= 1 << slot
        self._pairs += 1
        return True

    def stage(self, slot: int, hashes: bytes, blocks: np.ndarray) -> None:
        """Recovery: the node in ``slot`` indexes ``hashes`` (``HASH_BYTES`` each, concatenated) at
        ``blocks``, none of them indexed yet; they count from ``settle``."""
        if len(blocks):
            self._staged.append((slot, hashes, np.asarray(blocks, dtype=np.int64)))

    def settle(self) -> None:
        """Index everything staged: hashes held by several nodes go to the dict, those held by one
        to ``FrozenKeys`` (found by numpy: one sort of the hashes' first eight bytes)."""
        staged, self._staged = self._staged, []
        if not staged:
            return
        blob = b"".join(h for _, h, _ in staged)
        slots = np.repeat(np.array([s for s, _, _ in staged], dtype=np.int64), [len(b) for _, _, b in staged])
        blocks = np.concatenate([b for _, _, b in staged])
        del staged
        keys = np.frombuffer(blob, dtype="<u8").reshape(-1, 2)
        hi, lo = keys[:, 0], keys[:, 1]
        values = (blocks << SLOT_BITS) | slots
        order, starts, lengths = split_runs(hi)
        self._pairs += len(values)
        if self._entries or self._frozen is not None:  # not a fresh index: one by one
            self._pairs -= len(values)
            for i in order.tolist():
                self.add(blob[16 * i:16 * i + 16], int(slots[i]), int(blocks[i]))
            return
        single = order[starts[lengths == 1]]
        if len(single):
            self._frozen = FrozenKeys(hi[single], lo[single], values[single])
        multi = lengths > 1
        if multi.any():
            self._settle_shared(blob, order[np.repeat(multi, lengths)], lengths[multi], hi, lo, slots, blocks)

    def _settle_shared(self, blob: bytes, members: np.ndarray, lengths: np.ndarray, hi: np.ndarray,
                       lo: np.ndarray, slots: np.ndarray, blocks: np.ndarray) -> None:
        """The runs of ``split_runs`` longer than one (``members``, run after run): a run of one
        hash becomes a ``Shared`` entry, built from lists sliced per run; a run of several
        hashes alike at the top of their first eight bytes (rare) is added pair by pair."""
        offsets = np.cumsum(lengths) - lengths
        top, low = hi[members], lo[members]
        same = np.ones(len(members), dtype=np.int64)
        same[1:] = (top[1:] == top[:-1]) & (low[1:] == low[:-1])
        same[offsets] = 1  # a run's first member is compared with nothing
        mixed = (np.add.reduceat(same, offsets) != lengths).tolist()
        on, at = slots[members], blocks[members]
        on_list, at_list, first = on.tolist(), at.tolist(), members[offsets].tolist()
        bits = np.zeros(int(on.max()) + 1, dtype=bool)
        entries = self._entries
        for k, (off, n) in enumerate(zip(offsets.tolist(), lengths.tolist())):
            if mixed[k]:
                for i in members[off:off + n].tolist():
                    self._pairs -= 1
                    self.add(blob[16 * i:16 * i + 16], int(slots[i]), int(blocks[i]))
                continue
            i = first[k]
            shared = entries[blob[16 * i:16 * i + 16]] = Shared(zip(on_list[off:off + n], at_list[off:off + n]))
            bits[:] = False
            bits[on[off:off + n]] = True
            shared.mask = int.from_bytes(np.packbits(bits, bitorder="little").tobytes(), "little")

    def remove(self, h: bytes, slot: int) -> None:
        """Forget ``h`` on the node in ``slot`` (it must index it; the pool's flags say so)."""
        entries = self._entries
        e = entries.get(h)
        if e is None:
            e = self._thaw(h)
        self._pairs -= 1
        if type(e) is int:
            del entries[h]
            return
        del e[slot]
        e.mask &= ~(1 << slot)
        if len(e) == 1:
            ((other, block),) = e.items()
            entries[h] = (block << SLOT_BITS) | other

    def check(self) -> None:
        """A shared entry names two or more nodes and its mask is exactly theirs."""
        for h, e in self._entries.items():
            if type(e) is not int:
                assert len(e) >= 2, f"{h.hex()}: a shared entry with {len(e)} holders"
                mask = 0
                for slot in e:
                    mask |= 1 << slot
                assert e.mask == mask, f"{h.hex()}: its mask is not its holders'"

    # ---- the fleet-wide question ---------------------------------------------------------------

    def match(self, hashes: Sequence[bytes]) -> dict[int, int]:
        """Per slot, how many leading ``hashes`` that node indexes; slots with none are left out.
        One dict lookup and one AND per hash, plus one pass over the bits of each depth at which
        some nodes stop matching."""
        if self._frozen is not None:
            self._thaw_leading(hashes)
        depth: dict[int, int] = {}
        cur = 0
        for d, e in enumerate(map(self._entries.get, hashes)):
            if e is None:
                m = 0
            elif type(e) is int:
                m = 1 << (e & SLOT_MASK)
            else:
                m = e.mask
            if d == 0:
                cur = m
                continue
            new = cur & m
            if new != cur:
                depth.update(dict.fromkeys(slots_of(cur ^ new), d))
                cur = new
            if not cur:
                return depth
        if cur:
            depth.update(dict.fromkeys(slots_of(cur), len(hashes)))
        return depth

    def match_past(self, hashes: Sequence[bytes], extra: dict[bytes, int], among: int) -> dict[int, int]:
        """For the slots of ``among`` (a bitset) that hold leading ``hashes`` past their run in this
        index (``match``) when the blocks in ``extra`` (hash → bitset: the lower tiers') count too:
        how many leading hashes they hold then; the others are left out. One walk, two ANDs and
        two dict lookups per hash: ``hot`` (still in this index's run) and ``held`` (in either),
        and only the slots dropping out of ``held`` after ``hot`` are expanded, so its cost does not
        grow with the nodes holding the prefix hot. ``match`` itself is left as it was."""
        if self._frozen is not None:
            self._thaw_leading(hashes, past_misses=True)  # the lower tiers may go on past a miss here
        entries, get_extra = self._entries, extra.get
        total: dict[int, int] = {}
        hot = held = among
        for d, h in enumerate(hashes):
            e = entries.get(h)
            m = 0 if e is None else 1 << (e & SLOT_MASK) if type(e) is int else e.mask
            new = held & (m | get_extra(h, 0))
            if new != held:
                past = (held ^ new) & ~hot  # out now, out of the hot run before: a run past it
                if past:
                    total.update(dict.fromkeys(slots_of(past), d))
                held = new
                if not held:
                    return total
            hot &= m
        past = held & ~hot
        if past:
            total.update(dict.fromkeys(slots_of(past), len(hashes)))
        return total


def slots_of(bits: int) -> list[int]:
    """The set bits of ``bits``, lowest first (bin() runs in C; one pass over its digits)."""
    if not bits & (bits - 1):
        return [bits.bit_length() - 1] if bits else []
    digits = bin(bits)[:1:-1]  # '0b' dropped, lowest bit first
    return [i for i, c in enumerate(digits) if c == "1"]
