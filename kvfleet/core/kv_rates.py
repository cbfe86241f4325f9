"""A node's measured KV rates, and what they make a block held elsewhere worth against a hot one.

A node publishes ``KvRates`` in its membership record; the router derives from them, per node,
the weights of its cost (``kvfleet/router/routing.py``): a prompt block the node holds in a lower tier
(host memory, disk) is copied back instead of prefilled, and one another node holds is fetched
over the network (``Compute.FetchBlocks``). Either saves the prefill and costs a transfer, so the
block is worth, against one already in the pool (1) and one to compute (0)::

    weight = 1 - transfer time / prefill time        per token, clamped to [0, 1]
           = 1 - (bytes_per_token / transfer_bytes_per_s) / (1 / prefill_tokens_per_s)

Both times scale with the block's tokens, so the block size cancels. A copy as slow as the
prefill is worth nothing (0: a miss); a free one is a hot hit (1). None when a rate is unknown
(0): the router then falls back to its configured weight. Pure: no torch, no grpc.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class KvRates:
    """What a node measured; every rate >= 0, 0 meaning unknown (or, for the copy, no lower tier)."""

    prefill_tokens_per_s: float   # prompt tokens its engine computes per second
    copy_in_bytes_per_s: float    # lower tier (host memory, disk) → pool
    fetch_bytes_per_s: float      # another node's pool or tiers → this pool (Compute.FetchBlocks)
    bytes_per_token: float        # KV of one token, K and V of every layer, in the pool's dtype

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"kv rate {f.name} must be a finite number >= 0, got {value!r}")

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: object) -> KvRates:
        """From ``to_dict``'s shape: keys it does not know are ignored (a newer node's), a missing
        rate is unknown (0); ValueError (one line) for anything else."""
        if not isinstance(d, dict):
            raise ValueError(f"kv rates must be an object, got {type(d).__name__}")
        return cls(**{f.name: d.get(f.name, 0.0) for f in fields(cls)})


def _weight(prefill_tokens_per_s: float, bytes_per_token: float, transfer_bytes_per_s: float) -> float | None:
    if min(prefill_tokens_per_s, bytes_per_token, transfer_bytes_per_s) <= 0:
        return None
    ratio = (bytes_per_token / transfer_bytes_per_s) * prefill_tokens_per_s  # transfer time / prefill time
    return min(max(1.0 - ratio, 0.0), 1.0)


def lower_tier_weight(rates: KvRates | None) -> float | None:
    """A block the node holds in a lower tier against one in its pool (None: not measured)."""
    if rates is None:
        return None
    return _weight(rates.prefill_tokens_per_s, rates.bytes_per_token, rates.copy_in_bytes_per_s)


def peer_weight(rates: KvRates | None) -> float | None:
    """A block another node holds, fetched by this one, against one in its pool (None: not measured)."""
    if rates is None:
        return None
    return _weight(rates.prefill_tokens_per_s, rates.bytes_per_token, rates.fetch_bytes_per_s)
