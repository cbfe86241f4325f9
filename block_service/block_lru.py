"""One pool's cached blocks, least recently used first, as a doubly linked list threaded through
two int32 arrays indexed by block id.

An ``OrderedDict`` entry costs ~100 bytes per cached block (its key object, its link node, its
table slot); two int32 arrays cost 8 bytes per block of the pool, cached or not, and every
operation stays O(1): append at the most recently used end, remove from anywhere (a prefix hit
revives a cached block), pop the least recently used (eviction). A block outside the list has
``prev == next == -1``, so the arrays are a function of the order alone (a snapshot holds them as
they are, and two equal orders give equal arrays).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator, Sequence

NONE = -1


class BlockLru:
    __slots__ = ("prev", "next", "head", "tail", "size")

    def __init__(self, num_blocks: int) -> None:
        self.prev = array("i", [NONE]) * num_blocks
        self.next = array("i", [NONE]) * num_blocks
        self.head = NONE  # least recently used
        self.tail = NONE  # most recently used
        self.size = 0

    @classmethod
    def from_order(cls, num_blocks: int, order: Sequence[int]) -> BlockLru:
        """The list holding ``order``, least recently used first (a snapshot's), linked in C:
        ``next[order[i]] = order[i + 1]`` and back, by ``map`` over the arrays' ``__setitem__``."""
        lru = cls(num_blocks)
        if order:
            if not isinstance(order, array) or order.typecode != "i":
                order = array("i", order)
            deque(map(lru.next.__setitem__, order[:-1], order[1:]), maxlen=0)
            deque(map(lru.prev.__setitem__, order[1:], order[:-1]), maxlen=0)
            lru.head, lru.tail, lru.size = order[0], order[-1], len(order)
        return lru

    def order(self) -> array:
        """The blocks, least recently used first."""
        return array("i", self)

    def links(self) -> tuple[array, array, int, int, int]:
        """Everything the list is (two lists with the same order have equal links)."""
        return self.prev, self.next, self.head, self.tail, self.size

    def __len__(self) -> int:
        return self.size

    def __contains__(self, b: int) -> bool:
        return self.prev[b] != NONE or self.head == b

    def __iter__(self) -> Iterator[int]:
        nxt, b = self.next, self.head
        while b != NONE:
            yield b
            b = nxt[b]

    def append(self, b: int) -> None:
        """Make ``b`` (not in the list) the most recently used."""
        t = self.tail
        self.prev[b] = t
        if t == NONE:
            self.head = b
        else:
            self.next[t] = b
        self.tail = b
        self.size += 1

    def extend(self, blocks: list[int]) -> None:
        """``append`` each of ``blocks`` in order (one call for a whole release)."""
        if not blocks:
            return
        prev, nxt, t = self.prev, self.next, self.tail
        for b in blocks:
            prev[b] = t
            if t == NONE:
                self.head = b
            else:
                nxt[t] = b
            t = b
        self.tail = t
        self.size += len(blocks)

    def remove(self, b: int) -> None:
        """Take ``b`` (in the list) out of it."""
        prev, nxt = self.prev, self.next
        p, n = prev[b], nxt[b]
        if p == NONE:
            self.head = n
        else:
            nxt[p] = n
        if n == NONE:
            self.tail = p
        else:
            prev[n] = p
        prev[b] = nxt[b] = NONE
        self.size -= 1

    def remove_many(self, blocks: list[int]) -> None:
        """``remove`` each of ``blocks`` (all in the list; one call for a whole prefix hit)."""
        prev, nxt = self.prev, self.next
        head, tail = self.head, self.tail
        for b in blocks:
            p, n = prev[b], nxt[b]
            if p == NONE:
                head = n
            else:
                nxt[p] = n
            if n == NONE:
                tail = p
            else:
                prev[n] = p
            prev[b] = nxt[b] = NONE
        self.head, self.tail = head, tail
        self.size -= len(blocks)

    def pop_oldest(self) -> int:
        """Take the least recently used block out and return it (the list is not empty)."""
        b = self.head
        nxt = self.next
        n = nxt[b]
        self.head = n
        if n == NONE:
            self.tail = NONE
        else:
            self.prev[n] = NONE
            nxt[b] = NONE
        self.size -= 1
        return b
