"""The holder's side of ``Compute.FetchBlocks``: another node of the cluster asks for a tenant's
chain of KV blocks, this node streams the leading run it holds for that tenant.

    engine thread:  which blocks (kv/held_run.py) ─▶ one copy out per tier (kv/block_rows.gather)
    a worker thread: rows in order; then frame by frame (node/block_chunks.py: whole blocks, a
                     CRC-32 per block), each made while the one before it is on the wire
    event loop:      the frames as they are (``serve``), gRPC's flow control paces them

The copy is taken on the engine thread between steps, so it is what the pool held at one moment;
everything after works on the copy. A hash held under another salt (another tenant's, outside the
asking tenant's prefix group) ends the run, and is logged once per call with the caller and the
asking tenant (never whose the block is). The fence is the salt, not the tenant: a block a group
mate committed is served to the group's tenants (``FetchBlocksRequest.prefix_group``, the router's
decision), never across groups.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.kv.block_rows import Gathered, gather, layout_of
from kvfleet.compute_service.kv.held_run import HeldRun, leading_run
from kvfleet.compute_service.node.block_chunks import DEFAULT_CHUNK_BYTES, frames, split_hashes
from kvfleet.core import rpc
from kvfleet.core.access_guard import caller
from kvfleet.core.block_hash import tenant_extra_key
from kvfleet.v1 import compute_pb2 as pb

log = logging.getLogger(__name__)

MAX_RUN_BYTES = 512 << 20  # one call serves at most this much (its copy is held while it streams)
MAX_CHUNK_BYTES = rpc.MAX_MESSAGE_BYTES // 2  # a chunk and its header stay under the receiver's message limit


class InvalidFetch(ValueError):
    """A request that cannot be served as asked (the caller's mistake): INVALID_ARGUMENT."""


class BlockHolder:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def serve(self, request: pb.FetchBlocksRequest) -> AsyncIterator[bytes]:
        """The frames (encoded ``BlockChunk`` messages) of the run this node serves for ``request``;
        ``InvalidFetch`` for bad input."""
        try:
            hashes = split_hashes(request.block_hashes)
        except ValueError as e:
            raise InvalidFetch(str(e)) from None
        if not request.tenant:
            raise InvalidFetch("tenant is empty: blocks are served only for the tenant whose chain named them")
        tenant, group = request.tenant, request.prefix_group
        max_chunk = min(request.max_chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        run, got = await self.engine.call(lambda e: _take(e, tenant, hashes, group))
        if run.fenced_at is not None:
            log.warning("FetchBlocks by %s for tenant %r: block %d of the %d asked for is held under another salt; "
                        "serving the %d before it", caller() or "a peer without a certificate", tenant, run.fenced_at,
                        len(hashes), run.fenced_at)
        if got.why_short is not None:
            log.warning("FetchBlocks for tenant %r: %s; serving the %d blocks before it", tenant, got.why_short, got.n)
        rows = await asyncio.to_thread(got.rows)
        async for data in _made_ahead(frames(got.layout, run.blocks[:got.n], rows, max_chunk)):
            yield data


async def _made_ahead(made: Iterator[bytes]) -> AsyncIterator[bytes]:
    """``made``'s items, each made in a worker thread while the one before it is sent. Closed early
    (the caller went away), it makes nothing more: the frame being made is dropped when done."""
    end = object()
    ahead = asyncio.ensure_future(asyncio.to_thread(next, made, end))
    try:
        while (data := await ahead) is not end:
            ahead = asyncio.ensure_future(asyncio.to_thread(next, made, end))
            yield data
    finally:
        ahead.add_done_callback(lambda f: f.cancelled() or f.exception())  # a late failure goes unheard


def _take(engine, tenant: str, hashes: list[bytes], prefix_group: str = "") -> tuple[HeldRun, Gathered]:
    """On the engine thread: the run to serve and its bytes, copied out: blocks whose committing
    tenant's chains are salted as the asker's (``KVCacheManager.salt_of``)."""
    kv_cache, kv_scales, tiers = engine.runner.kv_cache, engine.runner.kv_scales, engine.tiers
    layout = layout_of(kv_cache)
    max_blocks = max(1, MAX_RUN_BYTES // (layout.kv_bytes + layout.scale_bytes))
    in_tiers = tiers.index.held if tiers is not None else (lambda _: None)
    run = leading_run(hashes, tenant, engine.kv.usage.find, in_tiers, max_blocks, same_salt(engine.kv, tenant, prefix_group))
    return run, gather(kv_cache, kv_scales, tiers, run)


def same_salt(kv, tenant: str, prefix_group: str) -> Callable[[str], bool]:
    """Whether the blocks a tenant committed here (``KVCacheManager`` ``kv``) may be served to
    ``tenant`` asking with ``prefix_group``: its own, or a tenant's whose chains take the same salt
    (a mate of its group; every tenant when prefixes are shared by config), never across groups."""
    salt = tenant_extra_key(tenant, kv.share_across_tenants, prefix_group)
    return lambda owner: owner == tenant or kv.salt_of(owner) == salt
