"""The router's link to block_service: how much of a prompt each node holds, and dead nodes' blocks.

The prompt's full blocks are hashed exactly as the nodes hash them (``kvfleet.block_hash``, with
the tenant as the first block's extra key), once per block size in use, and block_service's prefix
index answers per node how many leading blocks are committed there (hot), and how many more the
node keeps below its pool, in host memory or on disk (valued less than hot). When a node's lease expires the
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

from kvfleet.backoff import error_line
from kvfleet.block_hash import block_hashes, tenant_extra_key
from kvfleet.errors import NotFound, Unavailable
from router.nodes import RouterNode
from router.recent_routes import RecentRoutes
from router.routing import PrefixHit

log = logging.getLogger(__name__)


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

    def _hashes(self, tenant: str, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        return block_hashes(token_ids, block_size, tenant_extra_key(tenant, self.share_across_tenants))

    async def match(self, tenant: str, token_ids: Sequence[int], nodes: Sequence[RouterNode]) -> dict[str, PrefixHit]:
        """Per node, the prompt's leading blocks it holds hot and, past them, in a lower tier. A
        recent route counts as hot (its blocks are being computed there now)."""
        by_size: dict[int, list[str]] = {}
        for node in nodes:
            by_size.setdefault(node.info.block_size, []).append(node.node_id)
        cached: dict[str, PrefixHit] = {}
        for block_size, node_ids in by_size.items():
            hashes = self._hashes(tenant, token_ids, block_size)
            if not hashes:
                continue
            if self.client is not None:
                cached.update(await self._committed(hashes, node_ids))
            for node_id, n in self.recent.match(hashes, node_ids).items():
                hit = cached.get(node_id, PrefixHit())
                hot = max(hit.hot, n)
                cached[node_id] = PrefixHit(hot, max(hit.hot + hit.lower, n) - hot)
        return cached

    async def _committed(self, hashes: list[bytes], node_ids: list[str]) -> dict[str, PrefixHit]:
        """block_service's answer, or nothing when it cannot give one."""
        try:
            hot, lower = await self.client.match_tiers(hashes, node_ids)
            found = {n: PrefixHit(k, lower.get(n, 0)) for n, k in hot.items()}
        except NotFound:  # a node's pool not (yet) registered: it is being resynced
            return {}
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

    def routed(self, tenant: str, token_ids: Sequence[int], node: RouterNode) -> None:
        """``token_ids`` were just sent to ``node``: its blocks count as cached there for a while."""
        self.recent.record(node.node_id, self._hashes(tenant, token_ids, node.info.block_size))

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
        if self.client is not None:
            await self.client.close()


async def connect_prefix_lookup(address: str | None, etcd_url: str | None = None):
    """Lookups in block_service at ``address`` (``etcd``: the elected leader), following the leader
    etcd names whenever one is elected."""
    if not address:
        return BlockServicePrefixLookup()  # routing by load and this router's own recent routes
    from block_service import leader_client

    client = await leader_client.connect(address, etcd_url, timeout_s=5.0)
    try:
        await client.wait_ready(10.0)
    except (asyncio.TimeoutError, Unavailable):  # serve anyway: lookups answer once block_service does
        log.warning("block_service at %s not reachable yet; routing by load until it answers", address)
    return BlockServicePrefixLookup(client)
