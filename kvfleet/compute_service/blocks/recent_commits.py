"""Which block hashes this node committed, and in what order. Pure Python.

An early allocation (``AllocatorPolicy.ask``) is answered with the prefix hit block_service saw
when the ask was sent. A request that waits in the queue meanwhile (the scheduler holds it while
another sequence on the node prefills the same prefix) may find more of its prompt committed by
the time it is admitted; claiming the old grant would recompute those blocks. The policy keeps
this small record to tell: the first block the grant missed was committed *after* the ask went
(``committed_since``), so asking again now finds it cached.

Commits are numbered as they are queued; an ask is sent after every commit queued before it (one
flush sends the bookkeeping first), so ``mark()`` taken with the asks is the ask's horizon. The
record is bounded (oldest forgotten first): a hash forgotten only costs a missed re-ask.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class RecentCommits:
    def __init__(self, max_entries: int = 65_536):
        if max_entries < 1:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self._count = 0                                   # commits queued so far
        self._at: OrderedDict[bytes, int] = OrderedDict()  # hash → its latest commit's number, oldest first

    def record(self, block_hashes: Iterable[bytes]) -> None:
        """These blocks were just committed (queued to block_service)."""
        for h in block_hashes:
            self._count += 1
            self._at[h] = self._count
            self._at.move_to_end(h)
        while len(self._at) > self.max_entries:
            self._at.popitem(last=False)

    def mark(self) -> int:
        """The horizon of what was committed so far (taken when asks are sent after it)."""
        return self._count

    def committed_since(self, block_hash: bytes, mark: int) -> bool:
        """Whether ``block_hash`` was committed after ``mark`` was taken."""
        return self._at.get(block_hash, 0) > mark
