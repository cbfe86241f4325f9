"""The router's link to block_service: how much of a prompt each node holds, and dead nodes' blocks.

The prompt's full blocks are hashed exactly as the nodes hash them (``kvfleet.block_hash``, with
the tenant as the first block's extra key), once per block size in use, and block_service's prefix
index answers per node how many leading blocks are committed there. When a node's lease expires the
router tells block_service to drop the node's pool, so its blocks stop being charged to tenants.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvfleet.block_hash import block_hashes, tenant_extra_key
from router.nodes import RouterNode
from router.recent_routes import RecentRoutes

log = logging.getLogger(__name__)


class BlockServicePrefixLookup:
    """Per node, the leading blocks of a prompt it holds: committed ones as block_service's prefix
    index knows them (none without block_service), and those this router routed there moments ago
    (``RecentRoutes``), whichever reaches further."""

    def __init__(self, client=None, share_across_tenants: bool = False, recent: RecentRoutes | None = None):
        self.client = client
        self.share_across_tenants = share_across_tenants
        self.recent = recent or RecentRoutes()

    def _hashes(self, tenant: str, token_ids: Sequence[int], block_size: int) -> list[bytes]:
        return block_hashes(token_ids, block_size, tenant_extra_key(tenant, self.share_across_tenants))

    async def match(self, tenant: str, token_ids: Sequence[int], nodes: Sequence[RouterNode]) -> dict[str, int]:
        by_size: dict[int, list[str]] = {}
        for node in nodes:
            by_size.setdefault(node.info.block_size, []).append(node.node_id)
        cached: dict[str, int] = {}
        for block_size, node_ids in by_size.items():
            hashes = self._hashes(tenant, token_ids, block_size)
            if not hashes:
                continue
            if self.client is not None:
                cached.update(await self.client.match_prefix(hashes, node_ids))
            for node_id, n in self.recent.match(hashes, node_ids).items():
                cached[node_id] = max(cached.get(node_id, 0), n)
        return cached

    def routed(self, tenant: str, token_ids: Sequence[int], node: RouterNode) -> None:
        """``token_ids`` were just sent to ``node``: its blocks count as cached there for a while."""
        self.recent.record(node.node_id, self._hashes(tenant, token_ids, node.info.block_size))

    async def forget_node(self, node_id: str) -> None:
        self.recent.forget_node(node_id)
        if self.client is None:
            return
        from kvfleet.errors import NotFound  # noqa: PLC0415

        try:
            released = await self.client.deregister_node(node_id)
        except NotFound:
            return
        log.info("node %s left: block_service released its pool (%d sequences)", node_id, len(released))

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()


async def connect_prefix_lookup(address: str | None):
    if not address:
        return BlockServicePrefixLookup()  # routing by load and this router's own recent routes
    from block_service.client import BlockManagerClient  # noqa: PLC0415

    client = BlockManagerClient(address, timeout_s=5.0)
    await client.wait_ready(30.0)
    return BlockServicePrefixLookup(client)
