"""Where this node's peers are: every other node's address and state, from etcd's membership
entries (the same watch the router keeps, ``kvfleet.membership.watch_nodes``). A node fetches KV
only from a peer listed READY or DRAINING (a draining node still holds its blocks and still serves
them), at the address the peer published.

etcd down: the last view stays (a peer that left meanwhile fails its fetch, and the request is
prefilled); the watch lists again once etcd answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvfleet.membership import NodeInfo, NodeState, watch_nodes

log = logging.getLogger(__name__)

SERVING = (NodeState.READY, NodeState.DRAINING)


class PeerDirectory:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.peers: dict[str, NodeInfo] = {}
        self._task: asyncio.Task | None = None

    def address(self, node_id: str) -> str | None:
        """The address to fetch from ``node_id`` at; None unless it is a serving peer."""
        info = self.peers.get(node_id)
        return info.address if info is not None and info.state in SERVING and info.address else None

    def any_serving(self) -> bool:
        """Whether any peer could be fetched from now (none: no lookup is worth making)."""
        return any(info.state in SERVING and info.address for info in self.peers.values())

    def apply(self, node_id: str, info: NodeInfo | None) -> None:
        if node_id == self.node_id:
            return
        if info is None:
            self.peers.pop(node_id, None)
        else:
            self.peers[node_id] = info

    def start(self, client) -> None:
        """Follow etcd's membership through ``client`` (an aetcd client) until ``close``."""
        async def follow() -> None:
            async for change in watch_nodes(client):
                self.apply(change.node_id, change.info)

        self._task = asyncio.create_task(follow(), name=f"peers-of-{self.node_id}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
