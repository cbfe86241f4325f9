"""A request's cached prefix fetched from a peer at admission, when that beats prefilling it.

    request arrives ─▶ its prompt's block hashes (as the engine will name them)
        ─▶ block_service: per node, the leading blocks held (hot + lower tiers)
        ─▶ the best peer holds more than this node? the cost model (fetch_policy.py) decides
        ─▶ fetch the difference (kv_fetch.py): the blocks land cached in this pool, committed
           under the same hashes, so the engine's prefix cache finds them when it schedules
        ─▶ the request goes on to its early block allocation and the engine

The request waits while its blocks come; the engine keeps stepping every other request. Whatever
goes wrong (block_service or the peer down, a stall past the deadline, a bad block, no room here)
the request is prefilled from the first block not fetched: never a wrong token, never a block left
held (the fetch releases its own sequence). Two requests after the same run share one fetch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.node.fetch_figures import FetchFigures
from kvfleet.compute_service.node.fetch_policy import FetchCost, FetchPlan
from kvfleet.compute_service.node.kv_fetch import Fetched, fetch_blocks
from kvfleet.compute_service.node.peer_directory import PeerDirectory
from kvfleet.core.backoff import LogThrottle, error_line
from kvfleet.core.block_hash import block_hashes, tenant_extra_key

log = logging.getLogger(__name__)

LOOKUP_TIMEOUT_S = 2.0

# (hashes) -> (hot, lower): per node, the leading blocks block_service's index holds
MatchTiers = Callable[[Sequence[bytes]], Awaitable[tuple[dict[str, int], dict[str, int]]]]
Fetch = Callable[..., Awaitable[Fetched]]


@dataclass(slots=True, frozen=True)
class _Chain:
    """Whose chain is fetched: the tenant charged for it, and the group its salt is (if any)."""

    tenant: str
    prefix_group: str = ""


class PrefixFetcher:
    def __init__(self, node_id: str, engine: AsyncEngine, match: MatchTiers, peers: PeerDirectory, cost: FetchCost,
                 seed: bytes, share_across_tenants: bool = False, fetch: Fetch = fetch_blocks) -> None:
        self.node_id, self.engine, self.match, self.peers, self.cost = node_id, engine, match, peers, cost
        self.seed, self.share_across_tenants, self.fetch = seed, share_across_tenants, fetch
        self.figures = FetchFigures()
        self._running: dict[bytes, asyncio.Task] = {}  # the last hash of a run being fetched -> its fetch
        self._lookups_failing = LogThrottle()

    def prefill_tokens_per_s(self) -> float | None:
        return self.engine.engine.prefill_rate.tokens_per_s

    async def before_admission(self, tenant: str, token_ids: Sequence[int], source: str = "",
                               prefix_group: str = "") -> None:
        """Fetch what a peer holds of ``token_ids``' leading blocks if that beats prefilling them;
        from ``source`` (a prefill node that handed this sequence over) without asking where. The
        chain is salted with ``prefix_group`` when the tenant has one (the router's decision)."""
        settings = self.cost.settings
        if settings.kv_fetch == "off":
            return
        salt = tenant_extra_key(tenant, self.share_across_tenants, prefix_group)
        hashes = block_hashes(token_ids, self.cost.block_size, salt, self.seed)
        chain = _Chain(tenant, prefix_group)
        if source:
            await self._take_over(source, chain, hashes)
            return
        if len(hashes) < settings.kv_fetch_min_blocks or not self.peers.any_serving():
            return  # a node alone asks block_service nothing on its requests' way in
        try:
            hot, lower = await asyncio.wait_for(self.match(hashes), LOOKUP_TIMEOUT_S)
        except Exception as e:  # block_service away: prefill, as without peers
            self.figures.fallbacks["lookup"] += 1
            if self._lookups_failing.due():
                log.warning("node %s: prefix lookups for peer fetches fail (%s); prefilling", self.node_id,
                            error_line(e))
            return
        held = {n: hot.get(n, 0) + lower.get(n, 0) for n in hot.keys() | lower.keys()}
        local = held.pop(self.node_id, 0)
        peer, run = self._best_peer(held, local)
        if peer is None:
            if run > local:  # held more only by nodes not serving (or not listed yet)
                self.figures.fallbacks["no_peer"] += 1
            return
        plan = self.cost.plan(local, run, self.prefill_tokens_per_s())
        if not isinstance(plan, FetchPlan):
            self.figures.decisions[plan] += 1
            return
        self.figures.decisions["fetch"] += 1
        await self._fetch_once(peer, chain, hashes[:plan.blocks], plan)

    async def _take_over(self, source: str, chain: _Chain, hashes: list[bytes]) -> None:
        """A hand-over: ``source`` computed these blocks moments ago (block_service may not list
        them yet), so they are asked of it directly; what it cannot give is prefilled."""
        if self.peers.address(source) is None:
            self.figures.fallbacks["no_peer"] += 1
            return
        plan = self.cost.plan(0, len(hashes), self.prefill_tokens_per_s(), handover=True)
        if not isinstance(plan, FetchPlan):
            return
        self.figures.decisions["handover"] += 1
        await self._fetch_once(source, chain, hashes, plan)

    def _best_peer(self, held: dict[str, int], local: int) -> tuple[str | None, int]:
        """The serving peer holding the longest run past ``local`` (None if none), and that run."""
        run = local
        for node_id, n in sorted(held.items(), key=lambda kv: (-kv[1], kv[0])):
            if n <= local:
                break
            run = max(run, n)
            if self.peers.address(node_id) is not None:
                return node_id, n
        return None, run

    async def _fetch_once(self, peer: str, chain: _Chain, hashes: list[bytes], plan: FetchPlan) -> None:
        key = hashes[-1]  # a chain's last hash names the whole chain (and its salt: tenant or group)
        task = self._running.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch(peer, chain, hashes, plan))
            self._running[key] = task
            task.add_done_callback(lambda _: self._running.pop(key, None))
        await asyncio.shield(task)  # a request cancelled meanwhile leaves the fetch to finish for the others

    async def _fetch(self, peer: str, chain: _Chain, hashes: list[bytes], plan: FetchPlan) -> None:
        figures, tenant = self.figures, chain.tenant
        figures.in_flight += 1
        started = time.monotonic()
        try:
            got = await self.fetch(self.peers.address(peer) or "", peer, tenant, hashes, self.engine, plan.deadline_s,
                                   prefix_group=chain.prefix_group, peers=self.peers)
        finally:
            figures.in_flight -= 1
        seconds = time.monotonic() - started
        figures.seconds.observe(seconds)
        figures.blocks += got.imported
        figures.bytes += got.bytes
        if got.bytes:
            self.cost.observe_fetch(got.bytes, seconds)
        if got.blocks < len(hashes):
            figures.fallbacks[got.reason or "short"] += 1
        log.info("node %s: fetched %d blocks (%.1f MB) for tenant %r from node %s in %.3fs (open %.3f, stream %.3f, "
                 "commit %.3f); %d of %d held now", self.node_id, got.imported, got.bytes / 1e6, tenant, peer, seconds,
                 got.open_s, got.stream_s, got.commit_s, got.blocks, len(hashes))
