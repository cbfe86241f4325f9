"""A block_service client that follows the elected leader (``kvfleet.core.leader``).

    connect(address, etcd_url):  address "etcd" (or None) → start at the leader etcd names
                                 a fixed address         → start there
                                 with etcd_url           → retarget whenever etcd names a leader

A compute node or the router keeps one client for its life; when the leader changes, the client's
next calls go to the new one. What happens to the calls in between is the caller's existing outage
path: they fail UNAVAILABLE and the node resyncs; ``on_change`` lets it resync at once
instead of at its next backoff step. Without an election key (one block_service, no ``--etcd``)
the fixed address is kept.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.core.leader import FROM_ETCD, watch_leader

log = logging.getLogger(__name__)


async def connect(address: str | None, etcd_url: str | None, timeout_s: float = 30.0,
                  on_change: Callable[[str], None] | None = None) -> BlockManagerClient:
    """A client of ``address``, retargeted to etcd's leader when ``etcd_url`` is given."""
    fixed = None if address in (None, "", FROM_ETCD) else address
    if fixed is None and not etcd_url:
        raise ValueError("--block-service etcd needs --etcd: the leader's address is read there")
    client = BlockManagerClient(fixed, timeout_s=timeout_s)
    if not etcd_url:
        return client
    from kvfleet.core.membership import etcd_client

    etcd = etcd_client(etcd_url)
    first = asyncio.get_running_loop().create_future()

    async def follow() -> None:
        async for leader in watch_leader(etcd):
            if leader is not None and leader.address != client.target:
                log.info("block_service leader is %s%s", leader.address,
                         f" (was {client.target})" if client.target else "")
                client.retarget(leader.address)
                if on_change is not None and first.done():
                    on_change(leader.address)
            if not first.done():
                first.set_result(None)

    task = asyncio.create_task(follow(), name="block-service-leader")

    async def close() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await etcd.close()

    client.on_close(close)
    try:  # the first answer from etcd, so that a client that can start on the leader does
        await asyncio.wait_for(asyncio.shield(first), 5.0)
    except asyncio.TimeoutError:
        log.warning("etcd at %s does not answer yet; following the block_service leader once it does", etcd_url)
    return client
