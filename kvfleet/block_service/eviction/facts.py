"""What a pool keeps for a policy that asks for facts (``EvictionPolicy.needs_facts``): per block,
the prefix hits since its content was written, and the pool's tick. Nothing of it exists for a
policy that does not ask (LRU), so the common path pays nothing.

The tick is a logical clock, one step per release that caches blocks: the same calls give the same
ticks, live, replayed from the log, or restored from a snapshot (``to_state``), which a wall clock
could not. A block's hits restart at zero when it takes new content (taken fresh, evicted, claimed
by a node's sync).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

import numpy as np

from kvfleet.block_service.eviction.policy import CachedFacts


class BlockFacts:
    __slots__ = ("hits", "tick")

    def __init__(self, num_blocks: int) -> None:
        self.hits = array("I", bytes(4 * num_blocks))
        self.tick = 0

    def hit(self, blocks: Sequence[int]) -> None:
        """A prefix lookup found ``blocks`` (used or cached)."""
        hits = self.hits
        for b in blocks:
            hits[b] += 1

    def renew(self, blocks: Sequence[int]) -> None:
        """``blocks`` take new content: what they were hit for is gone."""
        hits = self.hits
        for b in blocks:
            hits[b] = 0

    def cached(self, cached: list[int], released: Sequence[int], tenants: Sequence[str], depth: int,
               block_size: int) -> CachedFacts:
        """The facts of ``cached``, some of ``released`` (a table's blocks, deepest first, the
        deepest at position ``depth - 1``; ``tenants`` charged for each, parallel to it)."""
        self.tick += 1
        at = {b: k for k, b in enumerate(released)}
        hits = self.hits
        return CachedFacts(tenants=[tenants[at[b]] for b in cached], hits=[hits[b] for b in cached],
                           costs=[(depth - at[b]) * block_size for b in cached], tick=self.tick)

    def to_state(self) -> dict:
        return {"hits": np.frombuffer(self.hits, dtype=np.uint32).astype("<u4").tobytes(), "tick": self.tick}

    @classmethod
    def from_state(cls, num_blocks: int, state: Mapping) -> BlockFacts:
        facts = cls(num_blocks)
        raw = state["hits"]
        if len(raw) != 4 * num_blocks:
            raise ValueError(f"a pool's hit counts have {len(raw)} bytes for {num_blocks} blocks")
        facts.hits = array("I", np.frombuffer(raw, dtype="<u4").astype(np.uint32).tobytes())
        facts.tick = int(state["tick"])
        return facts
