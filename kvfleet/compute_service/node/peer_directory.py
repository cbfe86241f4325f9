"""Where this node's peers are: every other node's address and state, from etcd's membership
entries (the same watch the router keeps, ``kvfleet.core.membership.watch_nodes``). A node fetches KV
only from a peer listed READY or DRAINING (a draining node still holds its blocks and still serves
them), at the address the peer published.

The channel to a peer is kept between fetches (``channel``): a fetch on a fresh one paid its
connection, its TLS handshake and HTTP/2's flow-control window growing from 64 KiB again. It is
closed when the peer leaves, publishes another address, or a fetch from it fails (``drop``: the
next fetch dials afresh instead of waiting out a reconnect's backoff), and when this process's
credentials change.

etcd down: the last view stays (a peer that left meanwhile fails its fetch, and the request is
prefilled); the watch lists again once etcd answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from kvfleet.core import rpc, tls
from kvfleet.core.identity import Identity
from kvfleet.core.membership import NodeInfo, NodeState, watch_nodes

log = logging.getLogger(__name__)

SERVING = (NodeState.READY, NodeState.DRAINING)
DROP_GRACE_S = 30.0  # a dropped channel's fetches under way get this long to end (the longest fetch deadline's default)


def dial(address: str, node_id: str) -> grpc.aio.Channel:
    """A channel to node ``node_id`` at ``address`` for its blocks: mutual TLS insisting on that
    node's certificate, messages as large as a chunk."""
    return rpc.channel(address, max_receive_bytes=rpc.MAX_MESSAGE_BYTES, peer=Identity.node(node_id))


class PeerDirectory:
    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.peers: dict[str, NodeInfo] = {}
        self._task: asyncio.Task | None = None
        self._channels: dict[str, tuple[str, object, grpc.aio.Channel]] = {}  # node -> (address, credentials, channel)
        self._closing: dict[asyncio.Task, grpc.aio.Channel] = {}  # dropped channels, their fetches ending

    def address(self, node_id: str) -> str | None:
        """The address to fetch from ``node_id`` at; None unless it is a serving peer."""
        info = self.peers.get(node_id)
        return info.address if info is not None and info.state in SERVING and info.address else None

    def any_serving(self) -> bool:
        """Whether any peer could be fetched from now (none: no lookup is worth making)."""
        return any(info.state in SERVING and info.address for info in self.peers.values())

    def channel(self, node_id: str) -> grpc.aio.Channel | None:
        """The kept channel to serving peer ``node_id`` (dialled now if none is kept for its address
        and this process's credentials); None when it is not a serving peer (or cannot be dialled)."""
        address = self.address(node_id)
        if address is None:
            return None
        credentials = tls.current()
        kept = self._channels.get(node_id)
        if kept is not None and kept[0] == address and kept[1] is credentials:
            return kept[2]
        self.drop(node_id)
        try:
            channel = dial(address, node_id)
        except Exception as e:  # a malformed address or id: the fetch dials again and logs it
            log.debug("peer %s at %s: cannot dial (%s)", node_id, address, e)
            return None
        self._channels[node_id] = (address, credentials, channel)
        return channel

    def drop(self, node_id: str, grace_s: float | None = DROP_GRACE_S) -> None:
        """Close the channel kept to ``node_id`` once the fetches under way on it end (``grace_s``
        at most; None: now); the next fetch dials again."""
        kept = self._channels.pop(node_id, None)
        if kept is not None:
            task = asyncio.get_running_loop().create_task(kept[2].close(grace_s))
            self._closing[task] = kept[2]
            task.add_done_callback(lambda done: self._closing.pop(done, None))

    def apply(self, node_id: str, info: NodeInfo | None) -> None:
        if node_id == self.node_id:
            return
        if info is None:
            self.peers.pop(node_id, None)
        else:
            self.peers[node_id] = info
        if node_id in self._channels and self.address(node_id) != self._channels[node_id][0]:
            self.drop(node_id)  # gone, not serving, or elsewhere now

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
        for node_id in list(self._channels):
            self.drop(node_id, grace_s=None)
        for channel in list(self._closing.values()):  # no grace now: what is under way is cancelled
            with contextlib.suppress(Exception):
                await channel.close(None)
        await asyncio.gather(*self._closing, return_exceptions=True)
