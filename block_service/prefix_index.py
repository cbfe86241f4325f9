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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import repeat
from operator import lshift, or_

SLOT_BITS = 20                  # up to a million nodes per page table
SLOT_MASK = (1 << SLOT_BITS) - 1
MAX_SLOTS = 1 << SLOT_BITS


class Shared(dict):
    """``{slot: block}`` of a hash two or more nodes name, with their bitset."""

    __slots__ = ("mask",)


_NOBODY = Shared()  # what a lookup of an unknown hash finds: nobody's block


class PrefixIndex:
    __slots__ = ("_entries", "_pairs")

    def __init__(self) -> None:
        self._entries: dict[bytes, int | Shared] = {}
        self._pairs = 0  # (hash, slot) pairs: what the pools' check counts against

    def __len__(self) -> int:
        """Distinct hashes indexed by at least one node."""
        return len(self._entries)

    @property
    def num_pairs(self) -> int:
        """(hash, node) pairs indexed."""
        return self._pairs

    def block(self, h: bytes, slot: int) -> int | None:
        """The block indexed for ``h`` on the node in ``slot``, or None."""
        e = self._entries.get(h)
        if e is None:
            return None
        if type(e) is int:
            return e >> SLOT_BITS if e & SLOT_MASK == slot else None
        return e.get(slot)

    def lookup(self, hashes: Sequence[bytes], slot: int) -> list[int]:
        """Blocks of the node in ``slot`` holding the leading ``hashes``, up to the first miss."""
        get = self._entries.get
        found = []
        for h in hashes:
            e = get(h, _NOBODY)
            if type(e) is int:
                if e & SLOT_MASK != slot:
                    break
                found.append(e >> SLOT_BITS)
            else:
                b = e.get(slot)
                if b is None:
                    break
                found.append(b)
        return found

    def holders(self, h: bytes) -> dict[int, int]:
        """``{slot: block}`` of every node indexing ``h``."""
        e = self._entries.get(h)
        if e is None:
            return {}
        if type(e) is int:
            return {e & SLOT_MASK: e >> SLOT_BITS}
        return dict(e)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._entries)

    # ---- changes (the pools call these, in step with their blocks) ------------------------------

    def add(self, h: bytes, slot: int, block: int) -> bool:
        """Index ``h`` at ``block`` for the node in ``slot`` unless that node already indexes ``h``;
        True if added."""
        entries = self._entries
        v = (block << SLOT_BITS) | slot
        e = entries.setdefault(h, v)
        if e is v:  # new to the fleet: one dict operation, the common case
            pass
        elif type(e) is int:
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

    def add_many(self, slot: int, hashes: Sequence[bytes], blocks: Sequence[int]) -> None:
        """``add`` each ``(hashes[i], blocks[i])`` for the node in ``slot``, which indexes none of
        these hashes yet (recovery: a pool's named blocks). The hashes new to the fleet — most of
        them: private suffixes — go in by one ``dict.update`` in C; only those other nodes
        already name (shared prefixes) take the per-hash path."""
        entries = self._entries
        mine = dict(zip(hashes, map(or_, map(lshift, blocks, repeat(SLOT_BITS)), repeat(slot))))
        for h in entries.keys() & mine.keys():
            self.add(h, slot, mine.pop(h) >> SLOT_BITS)
        entries.update(mine)
        self._pairs += len(mine)

    def remove(self, h: bytes, slot: int) -> None:
        """Forget ``h`` on the node in ``slot`` (it must index it; the pool's flags say so)."""
        entries = self._entries
        e = entries[h]
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
        entries = self._entries
        depth: dict[int, int] = {}
        cur = 0
        for d, h in enumerate(hashes):
            e = entries.get(h)
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
