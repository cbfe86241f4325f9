"""``BlockAllocator`` served by block_service over gRPC, kept off the engine's critical path.

The engine calls the allocator synchronously from its step thread; the block_service client is
asyncio, on the node's event loop. Three rules keep the step from waiting on the network:

- **Ask early.** A request's first allocation is asked for when the request reaches the node
  (``preallocate``, on the event loop, batched with other arrivals), so when the scheduler admits
  it the answer is already here. A mismatch (the engine hashed differently, or re-allocates after
  a preemption) falls back to asking then.
- **Write-behind.** ``commit``, ``release`` and reserve top-ups answer nothing the engine needs
  now, so they are queued and sent together after a step (``end_step``), in one ``ApplyMany``.
  What others wait for goes at the end of its step: releases (free blocks, the tenant's quota)
  and commits of prompt blocks (a request sharing the prefix may arrive any moment). Decode-time
  bookkeeping rides along with those, or goes on its own once it is due: a top-up a couple of
  steps before its sequence could need the block, a generated block's commit after at most
  ``defer_steps`` steps. A batch of decoding requests then costs block_service a call every few
  steps instead of one per step that crossed a block boundary.
- **One block ahead.** Every sequence holds one block more than the engine has been handed. When
  the engine crosses a block boundary, ``extend`` hands over that reserve at once and queues a
  top-up, sent before the sequence can fill the block it just got; the network is only on the
  path when no reserve was granted.
- **Order.** A call that needs an answer (``allocate``, an ``extend`` without reserve) first sends
  everything queued and waits for it, so block_service sees a node's changes in the order they
  happened (commits before the allocation that reuses them, releases before the pool fills).

    event loop:    preallocate ─queue─┐            flush: ApplyMany (top-ups, commits, releases), AllocateMany
    engine thread: allocate (answered) │ extend (reserve) │ commit, release ─queue─▶ end_step ─kick─┘

The reserve costs at most one block per running sequence, charged to its tenant like any other.
block_service therefore sees a sequence's length at block granularity (up to the reserve's end),
not token by token: its fill-level figures count a reserve block as full.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence

from kvfleet import block_hash
from kvfleet.allocator import AllocateRequest, Allocation, AllocatorStats, Refusal
from kvfleet.errors import NotFound

log = logging.getLogger(__name__)

DEFER_STEPS = 16   # the most steps a generated block's commit waits for company
TOPUP_MARGIN = 2   # a top-up goes this many steps before its sequence could need the block

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
        self._lock = threading.Lock()               # guards everything below
        self._tables: dict[str, list[int]] = {}     # seq → block ids block_service gave (handed + reserve)
        self._handed: dict[str, int] = {}           # seq → blocks the engine has been given
        self._commits: list[tuple[str, int, bytes]] = []
        self._releases: list[str] = []
        self._topups: dict[str, int] = {}           # seq → tokens to extend to (one block past handed)
        self._asks: list[tuple[AllocateRequest, asyncio.Future]] = []  # preallocations to send (loop)
        self._early: dict[str, tuple[AllocateRequest, Allocation]] = {}  # granted, not yet claimed
        self._flush_lock = asyncio.Lock()           # one flush at a time, in order (loop thread)
        self._in_step = False                       # between begin_step and end_step (engine thread)
        self.defer_steps = defer_steps
        self._step = 0                              # end_step calls so far
        self._urgent = False                        # a release or a prompt block's commit is queued
        self._due: int | None = None                # the step by which deferred bookkeeping must go
        self._prompt_blocks: dict[str, int] = {}    # seq → full blocks of its prompt (urgent commits)

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, coro_fn, seq_id: str | None = None):
        """Run ``coro_fn()`` on the loop under ``seq_id``'s trace context; wait (engine thread)."""
        context = self.trace_context_of(seq_id) if seq_id else None

        async def traced():
            from opentelemetry import context as otel_context  # noqa: PLC0415

            token = otel_context.attach(context) if context is not None else None
            try:
                await self._flush()  # everything queued before this call goes first
                self.num_rpcs += 1
                return await coro_fn()
            finally:
                if token is not None:
                    otel_context.detach(token)

        return asyncio.run_coroutine_threadsafe(traced(), self.loop).result()

    def begin_step(self) -> None:
        self._in_step = True

    def end_step(self) -> None:
        """The engine finished a step: send what is queued if it is urgent or due (returns at once)."""
        self._in_step = False
        self._step += 1
        with self._lock:
            send = self._urgent or (self._due is not None and self._step >= self._due)
        if send:
            self._send_soon()

    def _defer(self, steps: int) -> None:
        """What was just queued must be sent within ``steps`` more steps (lock held)."""
        due = self._step + max(steps, 0) + 1  # end_step counts this step first
        self._due = due if self._due is None else min(self._due, due)

    def _topup(self, seq_id: str, held: int, num_tokens: int) -> None:
        """Queue the reserve block past ``held`` blocks for a sequence now ``num_tokens`` long
        (lock held): due a little before decoding (a token a step) fills the blocks it has."""
        self._topups[seq_id] = (held + 1) * self.block_size
        self._defer(held * self.block_size - num_tokens - TOPUP_MARGIN)

    def _send_soon(self) -> None:
        """Have the loop flush what is queued, if anything (any thread; returns at once)."""
        with self._lock:
            if not (self._commits or self._releases or self._topups):
                return
        self.loop.call_soon_threadsafe(self._kick)

    def _kick(self) -> None:
        self.loop.create_task(self._flush())

    async def _flush(self) -> None:
        """Send what is queued, after any flush in flight (loop thread)."""
        async with self._flush_lock:
            await self._send()

    async def _send(self) -> None:
        with self._lock:
            self._urgent, self._due = False, None
            commits, self._commits = self._commits, []
            releases, self._releases = self._releases, []
            released = set(releases)
            topups = [(s, n) for s, n in self._topups.items() if s not in released]
            self._topups = {}
        asks, self._asks = self._asks, []
        try:
            with _untraced():  # bookkeeping of many requests at once: no request's trace
                await self._send_bookkeeping(commits, releases, topups)
        except Exception:  # block_service down or state lost: the node keeps serving from its KV
            log.exception("block_service flush failed (%d commits, %d releases, %d top-ups)",
                          len(commits), len(releases), len(topups))
        if asks:
            await self._send_asks(asks)

    async def _send_bookkeeping(self, commits, releases, topups) -> None:
        if not (commits or releases or topups):
            return
        # one call, applied in order: top-ups (they bring block_service's length of a sequence up to
        # the blocks the engine filled, so its commits below are of full blocks), commits (a block is
        # committed by its live sequence), releases
        self.num_rpcs += 1
        _, results = await self.client.apply(commits, releases, topups)
        with self._lock:
            for (seq_id, _), new in zip(topups, results):
                if isinstance(new, list) and seq_id in self._tables:
                    self._tables[seq_id].extend(new)

    async def _send_asks(self, asks: list[tuple[AllocateRequest, asyncio.Future]]) -> None:
        try:
            self.num_rpcs += 1
            results = await self.client.allocate_many([request for request, _ in asks])
        except Exception as e:  # e.g. one id already live: each asks again when admitted
            log.warning("early allocation of %d sequences failed: %s", len(asks), e)
            results = [None] * len(asks)
        for (request, done), result in zip(asks, results):
            if isinstance(result, Allocation):
                with self._lock:
                    self._early[request.seq_id] = (request, result)
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
        self._asks.append((AllocateRequest(self.node_id, seq_id, tenant, hashes, len(token_ids)), done))
        if len(self._asks) == 1:
            self.loop.call_soon(self._kick)  # arrivals of this loop iteration go in one call
        await done

    def forget(self, seq_id: str) -> None:
        """The request ended; if the scheduler never claimed its early allocation, give it back."""
        with self._lock:
            if self._early.pop(seq_id, None) is None:
                return
            self._releases.append(seq_id)
            self._urgent = True
        if not self._in_step:  # during a step (the engine thread finishing it) end_step sends it
            self._send_soon()

    # -- BlockAllocator ---------------------------------------------------------------------------

    def num_available(self) -> int:
        stats = self.stats()
        return stats.num_free + stats.num_cached

    def allocate(self, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int) -> Allocation | Refusal:
        with self._lock:
            early = self._early.pop(seq_id, None)
            if early is not None:
                request, result = early
                if list(request.block_hashes) == list(block_hashes) and request.num_tokens == num_tokens:
                    self._claim(seq_id, result, num_tokens)
                    return result
                self._releases.append(seq_id)  # asked differently: give it back, ask again below
                self._urgent = True
        result = self._call(lambda: self.client.allocate(self.node_id, seq_id, tenant, block_hashes, num_tokens), seq_id)
        if isinstance(result, Allocation):
            with self._lock:
                self._claim(seq_id, result, num_tokens)
        return result

    def _claim(self, seq_id: str, result: Allocation, num_tokens: int) -> None:
        """Record a granted table (lock held) and queue its reserve block."""
        self._tables[seq_id] = list(result.block_ids)
        self._handed[seq_id] = len(result.block_ids)
        self._prompt_blocks[seq_id] = num_tokens // self.block_size
        self._topup(seq_id, len(result.block_ids), num_tokens)

    def extend(self, growth: Sequence[tuple[str, int]]) -> list[list[int] | Refusal]:
        answers: dict[str, list[int] | Refusal] = {}
        short: list[tuple[str, int]] = []
        with self._lock:
            for seq_id, num_tokens in growth:
                need = -(-num_tokens // self.block_size)
                table, handed = self._tables[seq_id], self._handed[seq_id]
                if need <= len(table):
                    answers[seq_id] = table[handed:need]
                    handed = self._handed[seq_id] = max(handed, need)
                    if len(table) <= handed:  # the reserve is used up: ask for the next one
                        self._topup(seq_id, handed, num_tokens)
                else:
                    short.append((seq_id, num_tokens))
        if short:
            self._extend_now(short, answers)
        return [answers[seq_id] for seq_id, _ in growth]

    def _extend_now(self, short: list[tuple[str, int]], answers: dict) -> None:
        """No reserve for these: ask now, one block ahead, and exactly if that is refused."""
        ahead = [(s, (-(-n // self.block_size) + 1) * self.block_size) for s, n in short]
        results = self._call(lambda: self.client.extend(ahead), short[0][0])
        retry = [(s, n) for (s, n), r in zip(short, results) if isinstance(r, Refusal)]
        exact = dict(zip((s for s, _ in retry), self._call(lambda: self.client.extend(retry)))) if retry else {}
        with self._lock:
            for (seq_id, num_tokens), result in zip(short, results):
                result = exact.get(seq_id, result)
                if isinstance(result, Refusal):
                    answers[seq_id] = result
                    continue
                table = self._tables[seq_id]
                table.extend(result)
                need = -(-num_tokens // self.block_size)
                answers[seq_id] = table[self._handed[seq_id]:need]
                self._handed[seq_id] = need

    def commit(self, commits: Sequence[tuple[str, int, bytes]]) -> None:
        if not commits:
            return
        with self._lock:
            self._commits.extend(commits)
            if any(index < self._prompt_blocks.get(seq_id, index + 1) for seq_id, index, _ in commits):
                self._urgent = True  # a prompt's blocks: a request sharing the prefix may be on its way
            else:
                self._defer(self.defer_steps)

    def release(self, seq_ids: Sequence[str]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                self._tables.pop(seq_id, None)
                self._handed.pop(seq_id, None)
                self._topups.pop(seq_id, None)
                self._prompt_blocks.pop(seq_id, None)
            self._releases.extend(seq_ids)
            self._urgent = True
        if not self._in_step:  # an abort between steps: no end_step will come to send it
            self._send_soon()

    def stats(self) -> AllocatorStats:
        nodes, _ = self._call(lambda: self.client.stats([self.node_id]))
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

        async def register() -> None:
            try:
                released = await self.client.deregister_node(self.node_id)
                log.info("dropped a previous registration of %s (%d sequences)", self.node_id, len(released))
            except NotFound:
                pass
            await self.client.register_node(self.node_id, num_blocks, block_size, bytes_per_block)

        asyncio.run_coroutine_threadsafe(register(), self.loop).result()
        self.allocator = RemoteBlockAllocator(self.client, self.loop, self.node_id, num_blocks, block_size,
                                              self.trace_contexts.get)
        return self.allocator

    async def close(self, deregister: bool = True) -> None:
        """Send what is queued; with ``deregister`` drop the pool (its KV dies with this process)."""
        try:
            if self.allocator is not None:
                await self.allocator._flush()
            if deregister:
                await self.client.deregister_node(self.node_id)
        finally:
            await self.client.close()
