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

log = logging.getLogger(__name__)


class NoPrefixLookup:
    """Without block_service every node looks cold: routing falls back to load alone."""

    async def match(self, tenant: str, token_ids: Sequence[int], nodes: Sequence[RouterNode]) -> dict[str, int]:
        return {}

    async def forget_node(self, node_id: str) -> None:
        pass

    async def close(self) -> None:
        pass


class BlockServicePrefixLookup:
    def __init__(self, client, share_across_tenants: bool = False):
        self.client = client
        self.share_across_tenants = share_across_tenants

    async def match(self, tenant: str, token_ids: Sequence[int], nodes: Sequence[RouterNode]) -> dict[str, int]:
        by_size: dict[int, list[str]] = {}
        for node in nodes:
            by_size.setdefault(node.info.block_size, []).append(node.node_id)
        extra = tenant_extra_key(tenant, self.share_across_tenants)
        cached: dict[str, int] = {}
        for block_size, node_ids in by_size.items():
            hashes = block_hashes(token_ids, block_size, extra)
            if hashes:
                cached.update(await self.client.match_prefix(hashes, node_ids))
        return cached

    async def forget_node(self, node_id: str) -> None:
        from block_service.errors import NotFound  # noqa: PLC0415

        try:
            released = await self.client.deregister_node(node_id)
        except NotFound:
            return
        log.info("node %s left: block_service released its pool (%d sequences)", node_id, len(released))

    async def close(self) -> None:
        await self.client.close()


async def connect_prefix_lookup(address: str | None):
    if not address:
        return NoPrefixLookup()
    from block_service.client import BlockManagerClient  # noqa: PLC0415

    client = BlockManagerClient(address, timeout_s=5.0)
    await client.wait_ready(30.0)
    return BlockServicePrefixLookup(client)
