"""``BlockAllocator`` served by block_service over gRPC, kept off the engine's critical path.

The engine calls the allocator synchronously from its step thread; the block_service client is
asyncio, on the node's event loop. This module is the bridge between the two: it holds the lock,
the futures and the flush order, and calls the client. What is sent when (early allocation,
write-behind, one block ahead) is ``AllocatorPolicy``'s decision (allocator_policy.py):

    event loop:    preallocate ─queue─┐            flush: ApplyMany (top-ups, commits, releases), AllocateMany
    engine thread: allocate (answered) │ extend (reserve) │ commit, release ─queue─▶ end_step ─kick─┘

- **Order.** A call that needs an answer (``allocate``, an ``extend`` without reserve) first sends
  everything queued and waits for it, so block_service sees a node's changes in the order they
  happened (commits before the allocation that reuses them, releases before the pool fills). One
  flush runs at a time (``_flush_lock``), in the order they were started.
- **Write-behind.** ``commit``, ``release`` and ``end_step`` only queue and kick a flush: the
  engine's step never waits on the network for them, and a flush block_service cannot take is
  logged on the loop, never raised into the engine's thread.
- **One place to resync.** What block_service should hold for this node is ``live_sequences()``
  (claimed tables and early allocations not yet claimed); a node that must register again
  (block_service restarted or dropped it) does so in ``RemoteAllocatorFactory.register`` and
  sends those.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence

from compute_service.allocator_policy import (
    DEFER_STEPS,
    AllocatorPolicy,
    Bookkeeping,
    LiveSequence,
)
from kvfleet import block_hash
from kvfleet.allocator import AllocateRequest, Allocation, AllocatorStats, Refusal
from kvfleet.errors import NotFound

log = logging.getLogger(__name__)

TraceContextOf = Callable[[str], object]  # seq id → OpenTelemetry context (or None)


def _untraced():
    from opentelemetry.instrumentation.utils import suppress_instrumentation  # noqa: PLC0415

    return suppress_instrumentation()


class RemoteBlockAllocator:
    def __init__(self, client, loop: asyncio.AbstractEventLoop, node_id: str, num_blocks: int, block_size: int,
                 trace_context_of: TraceContextOf | None = None, defer_steps: int = DEFER_STEPS):
        self.client = client
        self.loop = loop
        self.node_id = node_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.trace_context_of = trace_context_of or (lambda seq_id: None)
        self.num_rpcs = 0
        self._lock = threading.Lock()               # guards the policy (engine thread and loop)
        self._policy = AllocatorPolicy(block_size, defer_steps)
        self._waiters: dict[str, list[asyncio.Future]] = {}  # seq → preallocations awaiting (loop)
        self._flush_lock = asyncio.Lock()           # one flush at a time, in order (loop thread)
        self._flushes: set[asyncio.Task] = set()    # flushes kicked off and not finished (loop thread)

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, coro_fn, seq_id: str | None = None):
        """Run ``coro_fn()`` on the loop under ``seq_id``'s trace context, after everything queued
        before it was sent; wait for its result (engine thread)."""
        context = self.trace_context_of(seq_id) if seq_id else None

        async def traced():
            from opentelemetry import context as otel_context  # noqa: PLC0415

            token = otel_context.attach(context) if context is not None else None
            try:
                await self.flush()
                return await coro_fn()
            finally:
                if token is not None:
                    otel_context.detach(token)

        return asyncio.run_coroutine_threadsafe(traced(), self.loop).result()

    def _send_soon(self) -> None:
        """Have the loop flush what is queued, if anything (any thread; returns at once)."""
        with self._lock:
            if not self._policy.has_bookkeeping():
                return
        self.loop.call_soon_threadsafe(self._kick)

    def _kick(self) -> None:
        task = self.loop.create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self) -> None:
        """Send what is queued, after any flush in flight (loop thread)."""
        async with self._flush_lock:
            await self._send()

    async def settle(self) -> None:
        """Return once the flushes kicked off so far have finished (loop thread): what the engine
        queued before is then applied at block_service, and what was deferred is still queued."""
        while self._flushes:
            await asyncio.gather(*self._flushes)

    async def _send(self) -> None:
        with self._lock:
            batch = self._policy.take()
            asks = self._policy.take_asks()
        try:
            with _untraced():  # bookkeeping of many requests at once: no request's trace
                await self._send_bookkeeping(batch)
        except Exception:  # block_service down or state lost: the node keeps serving from its KV
            log.exception("block_service flush failed (%d commits, %d releases, %d top-ups)",
                          len(batch.commits), len(batch.releases), len(batch.topups))
        if asks:
            await self._send_asks(asks)

    async def _send_bookkeeping(self, batch: Bookkeeping) -> None:
        if not batch:
            return
        self.num_rpcs += 1
        result = await self.client.apply(batch.commits, batch.releases, batch.topups)
        for error in result.errors:  # refused alone: the rest of the batch was applied
            log.warning("block_service refused %s", error.line())
        with self._lock:
            self._policy.fold_topups(batch.topups, result.growth)

    async def _send_asks(self, asks: list[AllocateRequest]) -> None:
        try:
            self.num_rpcs += 1
            results = await self.client.allocate_many(asks)
        except Exception as e:  # e.g. one id already live: each asks again when admitted
            log.warning("early allocation of %d sequences failed: %s", len(asks), e)
            results = [None] * len(asks)
        with self._lock:
            send = self._policy.fold_asks(asks, results)
        for request in asks:
            self._wake(request.seq_id)
        if send:  # grants of requests that ended while they were asked for
            self._send_soon()

    def _wake(self, seq_id: str) -> None:
        """The preallocations of ``seq_id`` are over (loop thread); a waiter cancelled meanwhile
        (its request's stream closed) is passed over."""
        for done in self._waiters.pop(seq_id, []):
            if not done.done():
                done.set_result(None)

    async def preallocate(self, seq_id: str, tenant: str, token_ids: list[int],
                          share_across_tenants: bool = False) -> None:
        """Ask now (event loop) for the blocks the scheduler will ask for when it admits ``seq_id``:
        the same hashes ``KVCacheManager.allocate`` sends (full blocks, the last token's left to
        compute). A refusal is not kept: the scheduler asks again when it admits the request."""
        reusable = block_hash.reusable_blocks(len(token_ids), self.block_size)
        hashes = block_hash.block_hashes(token_ids, self.block_size,
                                         block_hash.tenant_extra_key(tenant, share_across_tenants),
                                         max_blocks=reusable)
        done = self.loop.create_future()
        self._waiters.setdefault(seq_id, []).append(done)
        with self._lock:
            first = self._policy.ask(AllocateRequest(self.node_id, seq_id, tenant, hashes, len(token_ids)))
        if first:
            self.loop.call_soon(self._kick)  # arrivals of this loop iteration go in one call
        try:
            await done
        except asyncio.CancelledError:  # nobody will hand this request to the engine
            self.release([seq_id])
            raise

    def live_sequences(self) -> list[LiveSequence]:
        """What block_service holds for this node, as the node knows it (claimed and early)."""
        with self._lock:
            return self._policy.live_sequences()

    # -- BlockAllocator ---------------------------------------------------------------------------

    def begin_step(self) -> None:
        with self._lock:
            self._policy.begin_step()

    def end_step(self) -> None:
        """The engine finished a step: send what is queued if it is urgent or due (returns at once)."""
        with self._lock:
            send = self._policy.end_step()
        if send:
            self._send_soon()

    def allocate(self, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int) -> Allocation | Refusal:
        with self._lock:
            early = self._policy.allocate(seq_id, block_hashes, num_tokens)
        if early is not None:
            return early

        async def ask():
            self.num_rpcs += 1
            return await self.client.allocate(self.node_id, seq_id, tenant, block_hashes, num_tokens)

        result = self._call(ask, seq_id)
        if isinstance(result, Allocation):
            with self._lock:
                self._policy.claim(seq_id, tenant, result, num_tokens)
        return result

    def extend(self, growth: Sequence[tuple[str, int]]) -> list[list[int] | Refusal]:
        with self._lock:
            grown = self._policy.extend(growth)
        answers: dict[str, list[int] | Refusal] = dict(grown.answers)
        if grown.short:
            answers.update(self._call(lambda: self._extend_now(grown.short), grown.short[0][0]))
        return [answers[seq_id] for seq_id, _ in growth]

    async def _extend_now(self, short: list[tuple[str, int]]) -> dict[str, list[int] | Refusal]:
        """No reserve covers these: ask block_service (after the queue before them was sent)."""
        with self._lock:
            asks = self._policy.extend_asks(short)
        while asks:
            self.num_rpcs += 1
            results = await self.client.extend(asks)
            with self._lock:
                asks = self._policy.fold_extend(asks, results)
        with self._lock:
            return self._policy.hand_over()

    def commit(self, commits: Sequence[tuple[str, int, bytes]]) -> None:
        with self._lock:
            self._policy.commit(commits)

    def release(self, seq_ids: Sequence[str]) -> None:
        """Give back the sequences' blocks. From the engine (its step thread): whatever it holds.
        On the event loop (a request's stream ended): only what the engine never claimed, an
        early allocation; a claimed sequence may be in the engine's step right now, and the
        engine releases it itself when the request's abort reaches it."""
        on_loop = self._on_loop()
        with self._lock:
            send = self._policy.release(seq_ids, claimed=not on_loop)
        if on_loop:  # a preallocation of an ended request is not waited for
            for seq_id in seq_ids:
                self._wake(seq_id)
        if send:  # during a step (the engine thread finishing it) end_step sends it
            self._send_soon()

    def _on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop runs in this thread: the engine's
            return False

    def stats(self) -> AllocatorStats:
        async def ask():
            self.num_rpcs += 1
            return await self.client.stats([self.node_id])

        nodes, _ = self._call(ask)
        n = nodes[0]
        return AllocatorStats(num_blocks=n.num_blocks, num_free=n.num_free, num_cached=n.num_cached,
                              num_used=n.num_used, prefix_queries=n.counters.prefix_queries,
                              prefix_hits=n.counters.prefix_hits)


class RemoteAllocatorFactory:
    """What ``LLMEngine`` calls with the pool's shape: registers the pool, returns the allocator.

    A node id registered before (a previous run of this node that crashed) is dropped first: its
    sequences died with that process, and its blocks must not stay charged.
    """

    def __init__(self, client, node_id: str, loop: asyncio.AbstractEventLoop):
        self.client = client
        self.node_id = node_id
        self.loop = loop
        self.allocator: RemoteBlockAllocator | None = None
        self.trace_contexts: dict[str, object] = {}  # seq id → trace context, set by the Compute servicer

    @classmethod
    async def connect(cls, address: str, node_id: str, loop: asyncio.AbstractEventLoop) -> RemoteAllocatorFactory:
        from block_service.client import BlockManagerClient  # noqa: PLC0415

        client = BlockManagerClient(address)
        await client.wait_ready(30.0)
        return cls(client, node_id, loop)

    def __call__(self, num_blocks: int, block_size: int, bytes_per_block: int) -> RemoteBlockAllocator:
        """Called by the engine from a worker thread (never from the loop's own thread)."""

        asyncio.run_coroutine_threadsafe(self.register(num_blocks, block_size, bytes_per_block), self.loop).result()
        self.allocator = RemoteBlockAllocator(self.client, self.loop, self.node_id, num_blocks, block_size,
                                              self.trace_contexts.get)
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
        """Send what is queued; with ``deregister`` drop the pool (its KV dies with this process)."""
        try:
            if self.allocator is not None:
                await self.allocator.flush()
            if deregister:
                await self.client.deregister_node(self.node_id)
        finally:
            await self.client.close()
