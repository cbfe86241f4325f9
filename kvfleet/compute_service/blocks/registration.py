"""A compute node's pool at block_service, from its registration to its goodbye.

``RemoteAllocatorFactory`` is what ``LLMEngine`` calls with the pool's shape: it registers the
pool (waiting for block_service if it is not up yet) and returns the ``RemoteBlockAllocator``
(remote_allocator.py) the engine then speaks to; ``close`` sends what is queued and drops the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from kvfleet.compute_service.blocks.link import DOWN, trouble_of
from kvfleet.compute_service.blocks.remote_allocator import RemoteBlockAllocator
from kvfleet.core.backoff import Backoff, LogThrottle, error_line
from kvfleet.core.errors import NotFound

if TYPE_CHECKING:
    from kvfleet.block_service.client import BlockManagerClient

log = logging.getLogger(__name__)

T = TypeVar("T")


class RemoteAllocatorFactory:
    """What ``LLMEngine`` calls with the pool's shape: registers the pool, returns the allocator.

    A node id registered before (a previous run of this node that crashed) is dropped first: its
    sequences died with that process, and its committed blocks name KV this process does not
    have. A node started while block_service is down waits for it (``until_reachable``).
    """

    def __init__(self, client, node_id: str, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.node_id = node_id
        self.loop = loop
        self.allocator: RemoteBlockAllocator | None = None
        self.trace_contexts: dict[str, object] = {}  # seq id → trace context, set by the Compute servicer

    @classmethod
    async def connect(cls, address: str, node_id: str, loop: asyncio.AbstractEventLoop,
                      etcd_url: str | None = None,
                      on_client: Callable[[BlockManagerClient], None] | None = None) -> RemoteAllocatorFactory:
        """``address`` fixed, or ``etcd`` (the elected leader); with ``etcd_url`` the client follows
        the leader etcd names (``kvfleet.block_service.leader_client``) and a change resyncs at once.
        ``on_client`` sees the client before block_service is waited for (the leader probe)."""
        from kvfleet.block_service import leader_client

        factory: RemoteAllocatorFactory | None = None

        def leader_changed(_address: str) -> None:
            if factory is not None and factory.allocator is not None:
                factory.allocator.syncs.trouble()  # the new leader may lack what the old one never replicated
                factory.allocator.syncs.retry_now()

        client = await leader_client.connect(address, etcd_url, on_change=leader_changed)
        if on_client is not None:
            on_client(client)
        await until_reachable(node_id, f"block_service at {address}", lambda: client.wait_ready(2.0))
        factory = cls(client, node_id, loop)
        return factory

    def __call__(self, num_blocks: int, block_size: int, bytes_per_block: int) -> RemoteBlockAllocator:
        """Called by the engine from a worker thread (never from the loop's own thread)."""
        register = until_reachable(self.node_id, "block_service registration",
                                   lambda: self.register(num_blocks, block_size, bytes_per_block))
        asyncio.run_coroutine_threadsafe(register, self.loop).result()
        self.allocator = RemoteBlockAllocator(self.client, self.loop, self.node_id, num_blocks, block_size,
                                              self.trace_contexts.get, bytes_per_block=bytes_per_block)
        return self.allocator

    async def register(self, num_blocks: int, block_size: int, bytes_per_block: int) -> None:
        """Register this node's pool, dropping a previous registration of its id first."""
        try:
            released = await self.client.deregister_node(self.node_id)
            log.info("dropped a previous registration of %s (%d sequences)", self.node_id, len(released))
        except NotFound:
            pass
        await self.client.register_node(self.node_id, num_blocks, block_size, bytes_per_block)

    async def close(self, deregister: bool = True) -> None:
        """Send what is queued; with ``deregister`` drop the pool (its KV dies with this process).
        With block_service unreachable the node leaves without: the router drops the pool when
        the node's lease goes, and a node with this id starting again drops it too."""
        try:
            if self.allocator is not None:
                if self.allocator.link.up:
                    await self.allocator.flush()
                await self.allocator.syncs.close()
                if not self.allocator.link.up:
                    log.warning("node %s: block_service unreachable; leaving without deregistering", self.node_id)
                    return
            if deregister:
                await self.client.deregister_node(self.node_id)
        finally:
            await self.client.close()


async def until_reachable(node_id: str, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
    """``attempt()`` until block_service answers it: retried with backoff while it is unreachable,
    one log line every few seconds; any other error is raised."""
    backoff, throttle = Backoff(), LogThrottle()
    while True:
        try:
            return await attempt()
        except Exception as e:
            if trouble_of(e) != DOWN:
                raise
            if throttle.due():
                log.warning("node %s: waiting for %s (%s)", node_id, what, error_line(e))
        await asyncio.sleep(backoff.next())
