"""``value``: the cached block worth least goes first, GreedyDual-Size-Frequency style.

    priority = clock + frequency x cost / size       frequency = 1 + prefix hits since written
                                                     cost = prefill tokens a hit reaching it saves
                                                     size = 1 (every block is one block)

and the clock rises to each victim's priority, so a block nobody hits again ages out however costly
it was, while one hit often keeps coming back worth more (each hit revives it, and it is cached
again at the clock of that day). Ties go to the block cached first (``heap_policy``).

A block is worth at least every deeper block released with it (a running maximum from the deepest
block up): a hit can reach a deep block only through the blocks before it, so a prefix never goes
before the blocks that need it, and a chain goes deepest first as under the LRU. Without this the
first block of a system prompt (cost: one block of tokens) would be the cheapest of all and its
eviction would strand every deeper block behind it.
"""

from __future__ import annotations

from kvfleet.block_service.eviction.heap_policy import MAX_WORTH, HeapPolicy
from kvfleet.block_service.eviction.policy import CachedFacts


def gdsf_worth(facts: CachedFacts) -> list[int]:
    """Each block's worth above its clock: ``(1 + hits) x cost``, at least that of the deeper blocks
    before it in the release (deepest first), capped at ``MAX_WORTH``."""
    out: list[int] = []
    w = 0
    for hits, cost in zip(facts.hits, facts.costs):
        w = max(w, min((1 + hits) * cost, MAX_WORTH))
        out.append(w)
    return out


class BlockValue(HeapPolicy):
    """One bucket for the pool: the least valuable cached block first."""

    __slots__ = ()
    name = "value"
    per_tenant = False

    def worth(self, facts: CachedFacts) -> list[int]:
        return gdsf_worth(facts)
