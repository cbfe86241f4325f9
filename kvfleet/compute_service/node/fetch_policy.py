"""When a node fetches a prompt's cached prefix from a peer instead of prefilling it. Pure.

At admission the node knows, from block_service's prefix index, how many leading blocks of the
prompt it holds (any tier) and how many the best peer holds. The difference is fetched when

    gain · bytes_per_block / fetch_bytes_per_s  <  gain · block_size / prefill_tokens_per_s

both rates measured on this node and kept current: the prefill rate on its own mostly-prefill steps
(``engine/prefill_rate.py``, the warm-up's first), the fetch rate on its own fetches, each one's
bytes over its whole time, open and commit included (``kvfleet.core.decayed_rate``). Before the first
fetch the rate is unknown and a gain worth ``min_blocks`` is fetched: the way to measure it.

A fetch may take at most ``deadline_factor`` times the prefill it replaces (at least
``min_deadline_s``, at most ``max_deadline_s``), so a stalled or slow holder costs the request a
bounded delay before it is recomputed, never an unbounded one.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.core.decayed_rate import DecayedRate
from kvfleet.core.settings import check, setting

FETCH_MODES = ("auto", "always", "off")
HALF_LIFE_BYTES = 256 << 20


@dataclass(slots=True)
class KvFetchSettings:
    """KV from peers: fetch a prompt's cached prefix from the node that holds it instead of prefilling it"""

    kv_fetch: str = setting("auto", "auto: fetch when the measured transfer rate makes it faster than the prefill "
                            "it saves; always: whenever a peer holds more of the prompt; off: always prefill",
                            choices=FETCH_MODES)
    kv_fetch_min_blocks: int = setting(2, "the fewest blocks a peer must hold beyond this node for a fetch",
                                       at_least=1, metavar="N")
    kv_fetch_deadline_factor: float = setting(2.0, "a fetch may take this many times the prefill it replaces "
                                              "(then the rest is prefilled)", above=0, metavar="X")
    kv_fetch_min_deadline_s: float = setting(0.5, "the shortest deadline a fetch gets", above=0, metavar="S")
    kv_fetch_max_deadline_s: float = setting(30.0, "the longest deadline a fetch gets", above=0, metavar="S")

    def __post_init__(self) -> None:
        check(self)
        if self.kv_fetch_min_deadline_s > self.kv_fetch_max_deadline_s:
            raise ValueError(f"--kv-fetch-min-deadline-s {self.kv_fetch_min_deadline_s} is above "
                             f"--kv-fetch-max-deadline-s {self.kv_fetch_max_deadline_s}")


@dataclass(slots=True, frozen=True)
class FetchPlan:
    blocks: int           # leading blocks to hold once fetched (the peer's run)
    gain: int             # of them, blocks this node lacks
    deadline_s: float


class FetchCost:
    """The node's two measured rates and the decision they make."""

    def __init__(self, settings: KvFetchSettings, block_size: int, bytes_per_block: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.fetch_rate = DecayedRate(HALF_LIFE_BYTES)

    def observe_fetch(self, num_bytes: int, seconds: float) -> None:
        self.fetch_rate.observe(num_bytes, seconds)

    def recompute_s(self, blocks: int, prefill_tokens_per_s: float | None) -> float | None:
        return blocks * self.block_size / prefill_tokens_per_s if prefill_tokens_per_s else None

    def fetch_s(self, blocks: int) -> float | None:
        rate = self.fetch_rate.per_s
        return blocks * self.bytes_per_block / rate if rate else None

    def plan(self, local_blocks: int, peer_blocks: int, prefill_tokens_per_s: float | None,
             handover: bool = False) -> FetchPlan | str:
        """The fetch to make, or why not (one word: off, small, cost). A ``handover`` (the router
        decided: a prefill node computed the prompt for this node) is fetched unless fetching is off."""
        s = self.settings
        gain = peer_blocks - local_blocks
        if s.kv_fetch == "off":
            return "off"
        if gain < (1 if handover else s.kv_fetch_min_blocks):
            return "small"
        recompute, fetch = self.recompute_s(gain, prefill_tokens_per_s), self.fetch_s(gain)
        if s.kv_fetch == "auto" and not handover and recompute is not None and fetch is not None and fetch >= recompute:
            return "cost"
        budget = s.kv_fetch_deadline_factor * recompute if recompute is not None else s.kv_fetch_max_deadline_s
        deadline = min(max(budget, s.kv_fetch_min_deadline_s), s.kv_fetch_max_deadline_s)
        return FetchPlan(peer_blocks, gain, deadline)
