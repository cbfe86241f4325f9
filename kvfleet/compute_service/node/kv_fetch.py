"""The receiver's side of ``Compute.FetchBlocks``: import a tenant's chain of KV blocks from the peer
node that holds them, instead of recomputing their tokens.

    engine thread:  a temporary sequence for the chain, charged to the tenant (kv/chain_import.py):
                    the leading blocks this pool holds come back cached, the rest fresh
    event loop:     ask the peer for the rest (over the channel kept to it: peer_directory.py),
                    its chunks as the frames gRPC receives (no protobuf parse); a worker thread
                    keeps the leading blocks that pass every check (node/block_chunks.py), until
                    the stream ends, fails or the deadline passes
    engine thread:  write the verified blocks into the fresh ones, commit them under the same
                    hashes (block_service records the copy), release the sequence: one call

Each engine call waits for the step in progress, and on a loaded node those waits are most of a
small fetch's time (a prefill step of seconds), so a fetch makes two, the open and the commit
(one, the open, when it moves nothing); the release has its own call only after a failure or a
cancellation between them.

The pool's blocks are taken before anything crosses the network, so a full pool or a spent quota
costs no transfer, and the fresh blocks are this node's until the release: nothing else writes them
meanwhile. The release always happens (failure, deadline, cancellation), so neither node leaks a
block; a fresh block never written goes back to the free list uncommitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.kv import block_rows
from kvfleet.compute_service.kv.chain_import import OpenChain, commit_chain, open_chain
from kvfleet.compute_service.node.block_chunks import RunReader, TransferRefused
from kvfleet.compute_service.node.peer_directory import PeerDirectory, dial
from kvfleet.core.allocator import Refusal
from kvfleet.core.block_hash import HASH_BYTES
from kvfleet.core.ids import FETCH_SEQ_PREFIX
from kvfleet.v1 import compute_pb2 as pb

log = logging.getLogger(__name__)

# the stub's method: (request, timeout=seconds) -> the stream of chunks (frames, or messages: a test's double)
FetchCall = Callable[..., AsyncIterator[bytes | pb.BlockChunk]]
FETCH_METHOD = f"/{pb.DESCRIPTOR.services_by_name['Compute'].full_name}/FetchBlocks"


@dataclass(slots=True, frozen=True)
class Fetched:
    """What a fetch did: ``blocks`` leading blocks of the chain sit in the pool now (``held`` of
    them were there before it began, ``blocks - held`` came over the wire: ``bytes``, KV and
    scales); ``reason`` (None: the whole run asked for came) names why it stopped short, for the
    metrics: refused (no room or quota here), peer (the peer failed or refused, or the
    stream broke), checksum (a bad block, header or layout), deadline, import. Where its time
    went, in seconds: ``open_s`` (the pool's blocks taken, a wait for the engine's step in
    progress included), ``stream_s`` (asked, received, checked), ``commit_s`` (written,
    committed, released: another step's wait)."""

    held: int
    blocks: int
    bytes: int = 0
    reason: str | None = None
    open_s: float = 0.0
    stream_s: float = 0.0
    commit_s: float = 0.0

    @property
    def imported(self) -> int:
        return self.blocks - self.held


async def fetch_blocks(peer_address: str, peer_node_id: str, tenant: str, hashes: Sequence[bytes],
                       engine: AsyncEngine, deadline_s: float, prefix_group: str = "",
                       peers: PeerDirectory | None = None) -> Fetched:
    """The leading blocks of ``hashes`` (a prefix chain of ``tenant``'s, salted with its
    ``prefix_group`` when it has one) that sit in this node's
    pool as cached committed blocks once it returns: those it held already, and those fetched
    from node ``peer_node_id`` at ``peer_address`` (mutual TLS insisting on that node's
    certificate), over the channel ``peers`` keeps to it (dropped if the fetch fails at the
    peer; None: a channel dialled for this fetch alone). Never raises (cancellation aside): a
    failure is one log line and the count of what was imported whole and verified before it."""
    channel = peers.channel(peer_node_id) if peers is not None else None
    if channel is not None:
        got = await fetch_over(_frames(channel), f"node {peer_node_id}", tenant, hashes, engine, deadline_s,
                               prefix_group)
        if got.reason == "peer":
            peers.drop(peer_node_id)  # the next fetch dials afresh (a restarted peer: no reconnect backoff)
        return got
    try:
        channel = dial(peer_address, peer_node_id)
    except Exception as e:  # a malformed address or id: the caller's, but still only an answer of 0
        log.warning("KV fetch from node %s at %s: cannot dial (%s)", peer_node_id, peer_address, e)
        return Fetched(0, 0, reason="peer")
    async with channel:
        return await fetch_over(_frames(channel), f"node {peer_node_id}", tenant, hashes, engine, deadline_s,
                                prefix_group)


def _frames(channel: grpc.aio.Channel) -> FetchCall:
    """``FetchBlocks`` on ``channel``, its chunks as the frames gRPC receives (no protobuf parse)."""
    return channel.unary_stream(FETCH_METHOD, request_serializer=pb.FetchBlocksRequest.SerializeToString,
                                response_deserializer=None)


async def fetch_over(call: FetchCall, peer: str, tenant: str, hashes: Sequence[bytes], engine: AsyncEngine,
                     deadline_s: float, prefix_group: str = "") -> Fetched:
    """``fetch_blocks`` over an open stub method (a test's double)."""
    hashes = list(hashes)
    if not hashes or not tenant or any(len(h) != HASH_BYTES for h in hashes):
        log.warning("KV fetch from %s refused: %s", peer, "no hashes" if not hashes else
                    "no tenant" if not tenant else f"a hash that is not {HASH_BYTES} bytes")
        return Fetched(0, 0, reason="refused")
    fetch = _Fetch(f"{FETCH_SEQ_PREFIX}{uuid.uuid4().hex[:16]}")
    began = time.monotonic()
    try:
        try:
            opened = await engine.call(lambda e: _open(e, fetch, tenant, hashes))
        except Exception as e:
            opened = f"{type(e).__name__}: {e}"
        if not isinstance(opened, tuple):
            log.warning("KV fetch of %d blocks for tenant %r from %s: no blocks here: %s", len(hashes), tenant, peer,
                        opened.message() if isinstance(opened, Refusal) else opened)
            return Fetched(0, 0, reason="refused", open_s=time.monotonic() - began)
        chain, reader = opened
        held, opened_at = chain.num_cached, time.monotonic()
        if held == len(hashes):
            return Fetched(held, held, open_s=opened_at - began)
        # the clock starts once the blocks are taken: waiting for the engine's step in progress is a
        # wait a prefill would have had too (seen: a loaded node's long step spent a small fetch's deadline)
        stopped = await _receive(call, reader, tenant, hashes[held:], opened_at + deadline_s, prefix_group)
        received_at = time.monotonic()
        try:
            now = await engine.call(lambda e: _commit(e, fetch, chain, reader, tenant))
        except Exception as e:
            now, stopped = held, ("import", f"importing them failed ({type(e).__name__}: {e})")
        if stopped is not None:
            log.warning("KV fetch of %d blocks for tenant %r from %s: %s; imported %d (held %d already)",
                        len(hashes) - held, tenant, peer, stopped[1], now - held, held)
        per_block = reader.layout.kv_bytes + reader.layout.scale_bytes
        return Fetched(held, now, (now - held) * per_block, stopped[0] if stopped is not None else None,
                       opened_at - began, received_at - opened_at, time.monotonic() - received_at)
    finally:  # after the open and the commit (one thread, in order), whatever happened: even cancelled
        if not fetch.settled:  # the open or the commit did not end it (an error, a cancellation)
            released = engine.call(fetch.release)
            with contextlib.suppress(Exception):
                await asyncio.shield(released)


@dataclass(slots=True)
class _Fetch:
    """One fetch's temporary sequence: ``allocated`` is set and read on the engine thread only;
    ``settled`` is set there by the call that released it or allocated nothing (the open refused
    or found every block held, the commit), and read by the loop once that call has returned: no
    other call is owed."""

    seq_id: str
    allocated: bool = False
    settled: bool = False

    def release(self, engine) -> None:
        if self.allocated:
            self.allocated = False
            engine.allocator.release([self.seq_id])


async def _receive(call: FetchCall, reader: RunReader, tenant: str, asked: list[bytes],
                   deadline: float, prefix_group: str = "") -> tuple[str, str] | None:
    """Read the peer's stream into ``reader``; (reason, why) it stopped short (None: the whole run came)."""
    request = pb.FetchBlocksRequest(tenant=tenant, block_hashes=b"".join(asked), prefix_group=prefix_group)
    left = deadline - time.monotonic()
    if left <= 0:
        return "deadline", "the deadline passed before the fetch began"
    stream = None
    try:
        # asked inside: a channel closed meanwhile (another fetch found the peer gone and dropped it)
        # raises here, and that is the peer's failure like any other, not this request's
        stream = call(request, timeout=left)
        async with asyncio.timeout(left):
            async for chunk in stream:
                await _feed(reader, chunk)
        reader.finish()
    except TransferRefused as e:
        return "checksum", str(e)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return "deadline", "the deadline passed"
        return "peer", f"{e.code().name}: {e.details()}"
    except TimeoutError:
        return "deadline", "the deadline passed"
    except Exception as e:  # whatever a broken stream raises: the verified blocks still count
        return "peer", f"{type(e).__name__}: {e}"
    finally:
        cancel = getattr(stream, "cancel", None)  # a stream left early stops at the peer too
        if cancel is not None:
            cancel()
    return None


async def _feed(reader: RunReader, chunk: bytes | pb.BlockChunk) -> None:
    """``reader.feed(chunk)`` in a worker thread (its checksums and copy keep the loop free); however
    the wait ends (a deadline, a cancellation), the feed has ended too when this returns or raises,
    so nothing else reads the reader while it is fed."""
    feeding, abandoned = threading.Lock(), False

    def feed() -> None:
        with feeding:
            if not abandoned:
                reader.feed(chunk)

    try:
        await asyncio.to_thread(feed)
    finally:
        with feeding:  # a feed under way ends first (one chunk's checks); one not begun never begins
            abandoned = True


def _open(engine, fetch: _Fetch, tenant: str, hashes: list[bytes]) -> tuple[OpenChain, RunReader] | Refusal:
    """On the engine thread: the chain's blocks, and a reader for the part not held here (every
    block held: the sequence is released at once, as on a refusal)."""
    layout = block_rows.layout_of(engine.runner.kv_cache)
    tiers = engine.tiers
    chain = open_chain(engine.allocator, engine.kv.usage, fetch.seq_id, tenant, hashes,
                       tiers.demote if tiers is not None else None)
    if isinstance(chain, Refusal):
        fetch.settled = True
        return chain
    fetch.allocated = True
    reader = RunReader(layout, engine.kv.seed, hashes, chain.num_cached)
    if chain.num_cached == len(hashes):
        fetch.release(engine)
        fetch.settled = True
    return chain, reader


def _commit(engine, fetch: _Fetch, chain: OpenChain, reader: RunReader, tenant: str) -> int:
    """On the engine thread: write and commit the verified blocks, then release the fetch's
    sequence (whatever happened: one engine call, not two); the leading blocks held now."""
    try:
        upto = chain.num_cached + reader.verified
        if reader.verified:
            if engine.tiers is not None:
                engine.tiers.before_forward()  # the demotions' copies out of these blocks come first (CUDA)
            rows = reader.rows()
            kv_cache, kv_scales = engine.runner.kv_cache, engine.runner.kv_scales

            def write(fresh: range, block_ids: list[int]) -> None:
                block_rows.write(kv_cache, kv_scales, rows, range(fresh.start - chain.num_cached,
                                                                 fresh.stop - chain.num_cached), block_ids)

            named = [None] * chain.num_cached + reader.blocks  # by position in the chain; the held ones are not named again
            commit_chain(engine.allocator, engine.kv.usage, chain, named, upto, write, tenant)
            engine.kv.lookups.fetched.add(b.block_hash for b in reader.blocks[:reader.verified])  # their first hit: "peer"
        return upto
    finally:
        fetch.release(engine)
        fetch.settled = True
