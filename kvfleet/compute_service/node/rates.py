"""The node's measured KV rates (``kvfleet.core.kv_rates``) in its membership record, for the routers'
cost: its prefill rate (the engine's own steps), its lower tiers' copy-in rate (measured at start)
and its peer fetch rate (its own fetches), each kept current. Written at READY and again when a
rate moved by more than a tenth, at most once every few seconds; etcd away: the next tick retries.
"""

from __future__ import annotations

import asyncio
import logging

from kvfleet.compute_service.engine.llm_engine import LLMEngine
from kvfleet.compute_service.node.prefix_fetch import PrefixFetcher
from kvfleet.core.backoff import LogThrottle, error_line
from kvfleet.core.kv_rates import KvRates
from kvfleet.core.membership import NodeRegistration

log = logging.getLogger(__name__)

PUBLISH_EVERY_S = 5.0
CHANGE = 0.1  # a rate that moved by more than this share is published again


def current_rates(engine: LLMEngine, fetcher: PrefixFetcher | None) -> KvRates:
    """Read on the event loop: floats the step thread writes whole."""
    cost = engine.tiers.cost if engine.tiers is not None else None
    fetch = fetcher.cost.fetch_rate.per_s if fetcher is not None else None
    return KvRates(prefill_tokens_per_s=engine.prefill_rate.tokens_per_s or 0.0,
                   copy_in_bytes_per_s=cost.in_bytes_per_s if cost is not None else 0.0,
                   fetch_bytes_per_s=fetch or 0.0,
                   bytes_per_token=engine.bytes_per_block / engine.allocator.block_size)


def moved(old: KvRates | None, new: KvRates) -> bool:
    if old is None:
        return True
    for a, b in zip(old.to_dict().values(), new.to_dict().values()):
        if (a == 0) != (b == 0) or abs(b - a) > CHANGE * max(a, b):
            return True
    return False


async def publish_rates(registration: NodeRegistration, engine: LLMEngine, fetcher: PrefixFetcher | None,
                        every_s: float = PUBLISH_EVERY_S) -> None:
    """Forever (until cancelled): the rates into the membership record whenever they moved."""
    published: KvRates | None = None
    failing = LogThrottle(every_s=60.0)
    while True:
        rates = current_rates(engine, fetcher)
        if moved(published, rates):
            try:
                await registration.update(kv_rates=rates)
                published = rates
            except Exception as e:  # etcd away: the next tick tries again
                if failing.due():
                    log.warning("node: could not publish its KV rates in etcd (%s); retrying", error_line(e))
        await asyncio.sleep(every_s)
