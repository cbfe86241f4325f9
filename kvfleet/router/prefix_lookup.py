"""The router's link to block_service: how much of a prompt each node holds, and dead nodes' blocks.

The prompt's full blocks are hashed exactly as the nodes hash them (``kvfleet.core.block_hash``, with
the tenant, or its prefix group, as the first block's extra key), once per block size in use, and block_service's prefix
index answers per node how many leading blocks are committed there (hot), and how many more the
node keeps below its pool, in host memory or on disk (valued less than hot). It is asked about every
node it knows, not only the candidates: the blocks past a candidate's own run that another node
holds (``peer``, up to the longest run of any other node) can be fetched from it instead of
prefilled (valued less still). Nodes of another block size hash the prompt otherwise and hold none
of these hashes. When a node's lease expires the
router tells block_service to drop the node's pool, so its blocks stop being charged to tenants.

block_service being down is no reason to stop routing: a lookup that fails counts as "nothing
cached" (routing by load and recent routes), said in one WARNING when lookups start failing and one
INFO when they answer again; a pool that could not be dropped is dropped once block_service
answers, unless its node came back meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvfleet.core.backoff import error_line
from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from kvfleet.core.errors import NotFound, Unavailable
from kvfleet.core.run_to_end import run_to_end
from kvfleet.router.nodes import RouterNode
from kvfleet.router.recent_routes import RecentRoutes
from kvfleet.router.routing import NO_HIT, PrefixHit

log = logging.getLogger(__name__)

# A node's etcd key gone is not yet a node gone: an etcd outage longer than the nodes' leases drops
# every key while every node serves on (tests/partition: etcd_unreachable). Its pool is released
# only if it is not back within this long; a node back in time keeps its blocks and needs no resync.
FORGET_GRACE_S = 15.0


class BlockServicePrefixLookup:
    """Per node, the leading blocks of a prompt it holds: committed ones as block_service's prefix
    index knows them (none without block_service), and those this router routed there moments ago
    (``RecentRoutes``), whichever reaches further."""

    def __init__(self, client=None, share_across_tenants: bool = False, recent: RecentRoutes | None = None):
        self.client = client
        self.share_across_tenants = share_across_tenants
        self.recent = recent or RecentRoutes()
        self.failing = False              # lookups fail now (said once)
        self._to_forget: set[str] = set()  # nodes gone while block_service did not answer
        self._forgetting: dict[str, asyncio.Task] = {}  # nodes gone from etcd, released after a grace

    def _hashes(self, tenant: str, token_ids: Sequence[int], block_size: int, prefix_group: str = "") -> list[bytes]:
        """The prompt's full blocks' hashes as a node computes them for ``tenant`` (salted with its
        ``prefix_group`` when it has one: the router's decision, from the tenant's API key)."""
        return block_hashes(token_ids, block_size, tenant_extra_key(tenant, self.share_across_tenants, prefix_group))

    hashes = _hashes  # (public for pins: ``kvfleet/router/pinning.py`` pins the chain the lookups ask about)

    async def match(self, tenant: str, token_ids: Sequence[int], nodes: Sequence[RouterNode],
                    prefix_group: str = "") -> dict[str, PrefixHit]:
        """Per node, the prompt's leading blocks it holds hot and, past them, in a lower tier, then
        those only other nodes hold (only nodes with some). A recent route counts as hot (its blocks
        are being computed there now), though not for the others: nothing is there to fetch yet."""
        by_size: dict[int, list[str]] = {}
        for node in nodes:
            by_size.setdefault(node.info.block_size, []).append(node.node_id)
        cached: dict[str, PrefixHit] = {}
        for block_size, node_ids in by_size.items():
            hashes = self._hashes(tenant, token_ids, block_size, prefix_group)
            if not hashes:
                continue
            held = await self._committed(hashes) if self.client is not None else {}
            longest = _LongestRuns(held)
            recent = self.recent.match(hashes, node_ids)
            for node_id in node_ids:
                hit = held.get(node_id, NO_HIT)
                hot = max(hit.hot, recent.get(node_id, 0))
                run = max(hit.hot + hit.lower, hot)
                peer = max(longest.elsewhere(node_id) - run, 0)
                if run or peer:
                    cached[node_id] = PrefixHit(hot, run - hot, peer)
        return cached

    async def _committed(self, hashes: list[bytes]) -> dict[str, PrefixHit]:
        """block_service's answer for every node it knows, or nothing when it cannot give one."""
        try:
            # run_to_end: a client that leaves mid-lookup must not cancel the call (grpc.aio leaks it)
            hot, lower = await run_to_end(self.client.match_tiers(hashes))
            found = {n: PrefixHit(k, lower.get(n, 0)) for n, k in hot.items()}
        except Exception as e:
            if not self.failing:
                self.failing = True
                log.warning("prefix lookups in block_service fail (%s); routing by load and recent routes "
                            "until it answers", error_line(e))
            return {}
        if self.failing:
            self.failing = False
            log.info("block_service answers prefix lookups again")
            for node_id in list(self._to_forget):
                await self.forget_node(node_id)
        return found

    def node_back(self, node_id: str) -> None:
        """``node_id`` is listed again: its pool is its own to sync, not to drop."""
        self._to_forget.discard(node_id)
        pending = self._forgetting.pop(node_id, None)
        if pending is not None:
            pending.cancel()

    def node_left(self, node_id: str, grace_s: float = FORGET_GRACE_S) -> None:
        """``node_id``'s key left etcd: no recent routes to it now, its pool released in ``grace_s``
        unless it is listed again first (``node_back``)."""
        self.recent.forget_node(node_id)
        if node_id not in self._forgetting:
            self._forgetting[node_id] = asyncio.create_task(self._forget_after(node_id, grace_s))

    async def _forget_after(self, node_id: str, grace_s: float) -> None:
        await asyncio.sleep(grace_s)
        self._forgetting.pop(node_id, None)
        await self.forget_node(node_id)

    def routed(self, tenant: str, token_ids: Sequence[int], node: RouterNode, prefix_group: str = "") -> None:
        """``token_ids`` were just sent to ``node``: its blocks count as cached there for a while."""
        self.recent.record(node.node_id, self._hashes(tenant, token_ids, node.info.block_size, prefix_group))

    async def forget_node(self, node_id: str) -> None:
        self.recent.forget_node(node_id)
        if self.client is None:
            return
        self._to_forget.discard(node_id)
        try:
            released = await self.client.deregister_node(node_id)
        except NotFound:
            return
        except Exception as e:  # block_service down: drop the pool once it answers
            self._to_forget.add(node_id)
            log.warning("could not release the blocks of node %s (%s); will once block_service answers",
                        node_id, error_line(e))
            return
        log.info("node %s left: block_service released its pool (%d sequences)", node_id, len(released))

    async def close(self) -> None:
        for pending in self._forgetting.values():
            pending.cancel()
        if self.client is not None:
            await self.client.close()


class _LongestRuns:
    """The longest run of the prompt held (hot, then lower) by any node but a given one: the two
    longest runs of the fleet answer it for every node (one pass, not one per candidate)."""

    def __init__(self, held: dict[str, PrefixHit]):
        self.holder: str | None = None  # the node holding the longest run
        self.first = self.second = 0
        for node_id, hit in held.items():
            run = hit.hot + hit.lower
            if run > self.first:
                self.holder, self.first, self.second = node_id, run, self.first
            elif run > self.second:
                self.second = run

    def elsewhere(self, node_id: str) -> int:
        return self.second if node_id == self.holder else self.first


async def connect_prefix_lookup(address: str | None, etcd_url: str | None = None):
    """Lookups in block_service at ``address`` (``etcd``: the elected leader), following the leader
    etcd names whenever one is elected."""
    if not address:
        return BlockServicePrefixLookup()  # routing by load and this router's own recent routes
    from kvfleet.block_service import leader_client

    client = await leader_client.connect(address, etcd_url, timeout_s=5.0)
    try:
        await client.wait_ready(10.0)
    except (asyncio.TimeoutError, Unavailable):  # serve anyway: lookups answer once block_service does
        log.warning("block_service at %s not reachable yet; routing by load until it answers", address)
    return BlockServicePrefixLookup(client)
