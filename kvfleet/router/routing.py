"""Which node serves a request: KV-aware cost, a hot-spot guard and cold-start warming.

    cost(node) = w · (missed + (1 - l) · lower + (1 - p) · peer) + load(node)
    load(node) = (blocks of its requests still prefilling) + d · (blocks of its decoding requests)

A prompt block cached in the node's device pool (hot) saves its prefill there. Past the hot run,
one the node holds in a lower tier (host memory or disk: ``lower``) saves it too but costs a copy
back into the pool, and one only another node holds (``peer``: the blocks past the node's own run
up to the longest run any other node holds, hot or lower) costs a fetch over the network
(``Compute.FetchBlocks``) instead of a prefill. So each counts as a fraction of a miss: ``1 - l``
and ``1 - p``, where ``l`` and ``p`` are the share of a hot hit a copied or a fetched block is
worth; ``missed`` blocks are in no tier of any node. A node publishes its measured prefill, copy
and fetch rates (``kvfleet.core.kv_rates``: weight = 1 - transfer time / prefill time), and the router
derives its ``l`` and ``p`` from them; a node that publishes none gets ``lower_tier_hit_weight``
(default 0.5: a copy back costs about half a prefill) and ``peer_hit_weight`` (default 0.25: a
fetch costs more than a local copy). So for the same load hot beats lower beats peer beats miss
(for ``0 < p < l < 1``), and a busy node holding a prefix no longer forces a full recompute on an
idle one: the idle one fetches it, at ``1 - p`` of a miss.

An active block is work the node is already doing: a block its in-flight requests added there, not
the prefix they found cached (``RouterNode.start``), so requests sharing a prefix do not make the
node holding it look busier the more of them it serves.
A request's first token is on a node's clock behind the prefill already queued there, and a
prefill costs about a step per budget of tokens, while a sequence past its prefill adds one token
per step: so the blocks of requests still prefilling count in full and those of decoding requests
at ``d`` (``decode_block_weight``, default 0.1; 1 counts every active block alike: Dynamo's cost).
Measured (docs/benchmarks-history.md, "Routing"): counted in full, a node serving sixteen conversations' decodes
looked hundreds of blocks busier than its neighbour for a few dozen blocks of imbalance, and a
conversation's 12-block history lost to that noise on most second turns.
A node that lets short prompts first (``--long-prefill-token-threshold`` T, published in its
registration) computes a prompt with at most T tokens to compute ahead of the long prompts queued
there: such a prompt waits for the step in progress, whose long chunks are at most T tokens, not
for the documents behind it. So for a prompt that is short on a node (its missed blocks fewer than
T's), the long prompts' prefill blocks there count for at most T's blocks (``load_for``).
Counted in full, a node prefilling a document looked a document busier for a conversation's next
turn too, and the turn was sent to the other node to fetch its history: measured on
``bench/routing.py``, 4–6 of 32 later turns a round, each waiting a fetch (~0.3 s) its own node
would not have made it wait.
The lowest cost wins, ties at random. Prefix affinity alone would pile every request sharing a
popular prefix onto one node, so when the winner is far busier than the least-loaded node
(``load > ratio · least + margin``) the least-loaded node is taken instead.

A node that just became READY has empty caches and so the lowest cost: without care it would take
all traffic at once, before its allocator, caches and kernels settle. So for ``warmup_s`` after it
turns READY a node is only a candidate with probability ``share``, ramping linearly from
``warmup_min_share`` to 1.

Pure logic: loads and clocks are passed in.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.core.settings import check, setting

_EPS = 1e-9


@dataclass(slots=True, frozen=True)
class RoutingConfig:
    """routing: KV-aware cost, hot-spot guard, cold-start ramp (``kvfleet router``'s flags for them)"""

    prefix_weight: float = setting(1.0, "w: routing cost of one uncached prompt block, in active blocks", at_least=0,
                                   metavar="W")
    decode_block_weight: float = setting(
        0.1, "d: a decoding request's KV block in a node's load, against a block still to prefill, 0..1 (at 0.1 a "
             "first token waits on the prefill queued ahead of it; 1 counts every active block alike)",
        at_least=0, at_most=1, metavar="D")
    lower_tier_hit_weight: float = setting(
        0.5, "l: what a prompt block a node holds below its pool (host memory, disk) is worth against one in its "
             "pool, 0..1, for a node that publishes no measured rates (at 0.5 copying it back costs about half a "
             "prefill); hot > lower tier > miss for 0 < l < 1",
        at_least=0, at_most=1, metavar="L")
    peer_hit_weight: float = setting(
        0.25, "p: what a prompt block only another node holds (fetched instead of prefilled) is worth against one "
              "in the pool, 0..1, for a node that publishes no measured rates; hot > lower tier > peer > miss for "
              "0 < p < l < 1", at_least=0, at_most=1, metavar="P")
    hot_spot_ratio: float = setting(2.0, "the winner is far busier above ratio x the least load + margin: the least "
                                    "loaded node is taken instead", at_least=1)
    hot_spot_margin_blocks: int = 16
    warmup_s: float = setting(30.0, "cold-start traffic ramp of a new node, seconds", at_least=0, metavar="S")
    warmup_min_share: float = 0.1      # candidate probability right after READY

    def __post_init__(self) -> None:
        check(self)
        if self.hot_spot_margin_blocks < 0:
            raise ValueError(f"hot_spot_margin_blocks must be >= 0, got {self.hot_spot_margin_blocks}")
        if not 0 < self.warmup_min_share <= 1:
            raise ValueError(f"warmup_min_share must be in (0, 1], got {self.warmup_min_share}")


@dataclass(slots=True, frozen=True)
class NodeLoad:
    node_id: str
    active_blocks: int           # blocks the node's in-flight requests added beyond their cached prefixes
    cached_prefix_blocks: int    # leading prompt blocks already committed on the node (hot)
    ready_since: float           # when the node turned READY (same clock as `now`)
    lower_tier_prefix_blocks: int = 0  # prompt blocks past those the node holds in a lower tier
    prefill_blocks: int | None = None  # of active_blocks, those of requests still prefilling (None: all)
    peer_prefix_blocks: int = 0        # prompt blocks past the node's own run that another node holds
    lower_tier_weight: float | None = None  # l from the node's measured rates (None: the configured one)
    peer_weight: float | None = None        # p from the node's measured rates (None: the configured one)
    long_prefill_blocks: int = 0            # of prefill_blocks, those of prompts longer than the node's threshold
    long_prefill_threshold_blocks: int = 0  # the node's long-prefill threshold in whole blocks (0: off)


@dataclass(slots=True, frozen=True)
class PrefixHit:
    """How much of a prompt a node holds: ``hot`` leading blocks in its pool, then ``lower`` more in
    its lower tiers, then ``peer`` more that only other nodes hold (``NodeLoad``'s three prefix fields)."""

    hot: int = 0
    lower: int = 0
    peer: int = 0


NO_HIT = PrefixHit()


@dataclass(slots=True, frozen=True)
class RouteDecision:
    node_id: str
    cost: float
    cached_prefix_blocks: int
    reason: str  # "kv": lowest cost; "hot_spot": least loaded instead of a far busier winner;
                 # "warmup": lowest cost among the candidates left after the ramp left a warming node out


class NodePicker:
    def __init__(self, config: RoutingConfig = RoutingConfig(), rng: random.Random | None = None):
        self.config = config
        self._rng = rng or random.Random()
        self.decisions: Counter[tuple[str, str]] = Counter()  # (node id, reason) → decisions, for metrics

    def share(self, node: NodeLoad, now: float) -> float:
        """The probability that ``node`` is a candidate: ramps to 1 over the warm-up window."""
        if self.config.warmup_s == 0:
            return 1.0
        ramp = max(now - node.ready_since, 0.0) / self.config.warmup_s
        lo = self.config.warmup_min_share
        return min(1.0, lo + (1.0 - lo) * ramp)

    def load(self, node: NodeLoad) -> float:
        """The node's queued work in prefill blocks: prefilling requests' blocks in full, decoding
        ones' at ``decode_block_weight``."""
        prefill = node.active_blocks if node.prefill_blocks is None else node.prefill_blocks
        return prefill + self.config.decode_block_weight * (node.active_blocks - prefill)

    def load_for(self, node: NodeLoad, missed_blocks: int) -> float:
        """``load`` as a prompt with ``missed_blocks`` blocks to compute there waits on it: on a node
        that lets short prompts first, a short one (fewer missed blocks than the threshold's, so its
        partial last block keeps it within the threshold) is behind the long prompts' chunks of the
        step in progress only, at most the threshold's blocks of them."""
        cap = node.long_prefill_threshold_blocks
        if cap <= 0 or missed_blocks >= cap:
            return self.load(node)
        return self.load(node) - max(node.long_prefill_blocks - cap, 0)

    def tier_weights(self, node: NodeLoad) -> tuple[float, float]:
        """``(l, p)`` for ``node``: derived from its measured rates, else the configured ones."""
        c = self.config
        return (c.lower_tier_hit_weight if node.lower_tier_weight is None else node.lower_tier_weight,
                c.peer_hit_weight if node.peer_weight is None else node.peer_weight)

    @staticmethod
    def missed(node: NodeLoad, num_prompt_blocks: int) -> tuple[int, int, int]:
        """``(lower, peer, missed)``: the prompt's blocks past the node's hot run that it copies back
        from a lower tier, fetches from a peer, and computes."""
        hot = min(node.cached_prefix_blocks, num_prompt_blocks)
        lower = min(node.lower_tier_prefix_blocks, num_prompt_blocks - hot)
        peer = min(node.peer_prefix_blocks, num_prompt_blocks - hot - lower)
        return lower, peer, num_prompt_blocks - hot - lower - peer

    def to_compute(self, node: NodeLoad, num_prompt_blocks: int) -> int:
        """The prompt's blocks ``node`` would compute, as this picker sees them: with ``prefix_weight``
        0 it routes by load alone, blind to every cache, so the whole prompt."""
        return self.missed(node, num_prompt_blocks)[2] if self.config.prefix_weight > 0 else num_prompt_blocks

    def cost(self, node: NodeLoad, num_prompt_blocks: int) -> float:
        lower, peer, missed = self.missed(node, num_prompt_blocks)
        lower_weight, peer_weight = self.tier_weights(node)
        prefill = missed + (1.0 - lower_weight) * lower + (1.0 - peer_weight) * peer
        return self.config.prefix_weight * prefill + self.load_for(node, self.to_compute(node, num_prompt_blocks))

    def choose(self, nodes: Sequence[NodeLoad], num_prompt_blocks: int, now: float) -> RouteDecision | None:
        """The node for a prompt of ``num_prompt_blocks`` full blocks; None when ``nodes`` is empty.
        The caller leaves out the nodes that already failed this request."""
        if not nodes:
            return None
        candidates = [n for n in nodes if self._rng.random() < self.share(n, now)] or nodes
        costs = [self.cost(n, num_prompt_blocks) for n in candidates]
        best_cost = min(costs)
        winner = self._rng.choice([n for n, c in zip(candidates, costs) if c <= best_cost + _EPS])
        loads = {n.node_id: self.load_for(n, self.to_compute(n, num_prompt_blocks)) for n in candidates}
        least = min(loads.values())
        limit = self.config.hot_spot_ratio * least + self.config.hot_spot_margin_blocks
        if loads[winner.node_id] > limit:
            winner = self._rng.choice([n for n in candidates if loads[n.node_id] <= least + _EPS])
            reason = "hot_spot"
        else:
            reason = "warmup" if len(candidates) < len(nodes) else "kv"
        self.decisions[winner.node_id, reason] += 1
        return RouteDecision(
            node_id=winner.node_id,
            cost=self.cost(winner, num_prompt_blocks),
            cached_prefix_blocks=winner.cached_prefix_blocks,
            reason=reason,
        )
