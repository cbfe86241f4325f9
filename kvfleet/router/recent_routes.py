"""Prefixes the router has just sent to a node, remembered for a short while. Pure Python.

block_service learns of a block only when it is committed: after the prefill that writes it and
the node's write-behind flush. Requests sharing a prefix that arrive in a burst would each find
nothing cached and scatter over the nodes, each paying the prefill again. The router therefore
counts the blocks it has just routed somewhere as (soon) cached there, the way Dynamo's and llm-d's
routers index their own decisions; block_service's committed view stays the ground truth after
the entries expire.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence


class RecentRoutes:
    def __init__(self, ttl_s: float = 30.0, max_entries: int = 200_000,
                 clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("ttl_s and max_entries must be positive")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self._expiry: OrderedDict[tuple[str, bytes], float] = OrderedDict()  # oldest first

    def record(self, node_id: str, block_hashes: Sequence[bytes]) -> None:
        """``node_id`` is about to hold these (chained) blocks."""
        expiry = self.clock() + self.ttl_s
        for h in block_hashes:
            key = (node_id, h)
            self._expiry[key] = expiry
            self._expiry.move_to_end(key)
        while len(self._expiry) > self.max_entries:
            self._expiry.popitem(last=False)

    def match(self, block_hashes: Sequence[bytes], node_ids: Sequence[str]) -> dict[str, int]:
        """Per node, how many leading blocks of ``block_hashes`` were routed there recently."""
        self._expire()
        counts: dict[str, int] = {}
        for node_id in node_ids:
            n = 0
            while n < len(block_hashes) and (node_id, block_hashes[n]) in self._expiry:
                n += 1
            if n:
                counts[node_id] = n
        return counts

    def forget_node(self, node_id: str) -> None:
        for key in [k for k in self._expiry if k[0] == node_id]:
            del self._expiry[key]

    def _expire(self) -> None:
        now = self.clock()
        while self._expiry:
            key, expiry = next(iter(self._expiry.items()))
            if expiry > now:
                break
            del self._expiry[key]
