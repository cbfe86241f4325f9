"""The one path from a compute node to block_service, on the node's event loop: flushes of the
write-behind queue and the early asks, in the order they were started, and the sync. Glue: what to
send and what each answer changes is ``AllocatorPolicy``'s (allocator_policy.py); this moves it.

    engine thread ──answer()──┐                          ┌─▶ ApplyMany (top-ups, commits, drops, releases, tier moves)
    engine thread ──kick()────┼─▶ flush lock, in order ──┼─▶ AllocateMany (early asks) ─▶ wake their requests
    BlockSync ──────sync()────┘                          └─▶ SyncNode (the node's live sequences)

- **Order.** One flush at a time (``_flush_lock``); a call that needs an answer (``answer``) first
  sends everything queued, so block_service sees a node's changes in the order they happened. An
  answer is folded into the policy inside that lock, so a sync never sees block_service hold what
  the node does not know yet.
- **Never stuck on a peer.** An answer is waited for at most ``ANSWER_TIMEOUT_S``, a batch or a
  sync at most ``SEND_TIMEOUT_S``. When block_service is unreachable or has lost this node, the
  link is marked (``BlockLink``), answers are "not now" at once, bookkeeping stays queued, and
  ``BlockSync`` retries the sync with backoff. A flush block_service cannot take is logged here,
  never raised into the engine's thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

from kvfleet.compute_service.blocks.allocator_policy import AllocatorPolicy, Bookkeeping
from kvfleet.compute_service.blocks.link import DOWN, BlockLink, trouble_of
from kvfleet.compute_service.blocks.sync import BlockSync, SyncOutcome
from kvfleet.compute_service.blocks.tier_queue import TierQueue
from kvfleet.compute_service.blocks.topup_lead import Pace
from kvfleet.core.allocator import AllocateRequest, TierChange
from kvfleet.core.backoff import error_line
from kvfleet.core.errors import NotFound
from kvfleet.core.tracing import BatchLinks, batch_span

log = logging.getLogger(__name__)

TraceContextOf = Callable[[str], object]  # seq id → OpenTelemetry context (or None)
OnRefused = Callable[[list[str], str], None]  # (seq ids, why) block_service refused to hold after a sync

ANSWER_TIMEOUT_S = 3.0   # the most the engine's step waits for block_service (what was queued, then its answer)
SEND_TIMEOUT_S = 10.0    # the most a bookkeeping batch or a sync may take before the link counts as down


class BlockSender:
    def __init__(self, client, loop: asyncio.AbstractEventLoop, node_id: str, pool: tuple[int, int, int],
                 policy: AllocatorPolicy, lock: threading.Lock, tiers: TierQueue, trace_context_of: TraceContextOf):
        self.client = client
        self.loop = loop
        self.node_id = node_id
        self.pool = pool                  # (num_blocks, block_size, bytes_per_block), sent with a sync
        self.policy = policy              # shared with the allocator, always under ``lock``
        self.lock = lock
        self.tiers = tiers
        self.trace_context_of = trace_context_of
        self.on_refused: OnRefused | None = None  # set by the node once its engine runs
        self.num_rpcs = 0
        self.pace = Pace()                # ApplyMany's round trip (here) and the engine's step, under ``lock``
        self._asked_at: float | None = None  # when the oldest bookkeeping not yet taken was asked to go
        self.link = BlockLink()
        self.syncs = BlockSync(node_id, self.sync)
        self._links = BatchLinks(trace_context_of)  # the requests each bookkeeping batch serves
        self._waiters: dict[str, list[asyncio.Future]] = {}  # seq → preallocations awaiting their answer
        self._flush_lock = asyncio.Lock()
        self._flushes: set[asyncio.Task] = set()  # flushes kicked off and not finished

    def answer(self, coro_fn: Callable[[], Awaitable], unavailable: Callable[[], object], seq_id: str | None = None):
        """(Engine thread.) Run ``coro_fn()`` on the loop under ``seq_id``'s trace context, after
        everything queued before it was sent, inside the flush lock, and wait for its result. With
        the link not up, or block_service not answering in time, the answer is ``unavailable()``."""
        if not self.link.up:
            return unavailable()
        context = self.trace_context_of(seq_id) if seq_id else None

        async def traced():
            from opentelemetry import context as otel_context

            token = otel_context.attach(context) if context is not None else None
            try:
                async with self._flush_lock:
                    return await asyncio.wait_for(self._send_then(coro_fn, unavailable), ANSWER_TIMEOUT_S)
            except Exception as e:
                if not self.trouble(e):
                    raise
                return unavailable()
            finally:
                if token is not None:
                    otel_context.detach(token)

        return asyncio.run_coroutine_threadsafe(traced(), self.loop).result()

    async def _send_then(self, coro_fn, unavailable: Callable[[], object]):
        await self._send()
        return await coro_fn() if self.link.up else unavailable()

    def trouble(self, error: BaseException) -> bool:
        """If ``error`` is the link's (block_service down, or it lost this node), mark the link and
        make sure a resync runs; True then (loop thread)."""
        trouble = trouble_of(error)
        if trouble is None:
            return False
        if self.link.lose(trouble, time.monotonic()):
            what = "is unreachable" if trouble == DOWN else "lost this node's state"
            log.warning("node %s: block_service %s (%s); holding what needs it and resyncing",
                        self.node_id, what, error_line(error))
        self.syncs.trouble()
        return True

    def send_soon(self) -> None:
        """Have the loop flush what is queued, if anything (any thread; returns at once)."""
        with self.lock:
            if not self.policy.has_bookkeeping() and not self.tiers.pending:
                return
            if self._asked_at is None:
                self._asked_at = time.monotonic()
        self.loop.call_soon_threadsafe(self.kick)

    def kick(self) -> None:
        """Start a flush (loop thread)."""
        task = self.loop.create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self) -> None:
        """Send what is queued, after any flush in flight (loop thread)."""
        async with self._flush_lock:
            await self._send()

    async def settle(self) -> None:
        """Return once the flushes kicked off so far have finished (loop thread)."""
        while self._flushes:
            await asyncio.gather(*self._flushes)

    def hold_links(self, seq_ids: Sequence[str]) -> None:
        """Keep these requests' trace contexts for the batch that releases them (they may be gone by then)."""
        self._links.hold(seq_ids)

    def waiter(self, seq_id: str) -> asyncio.Future:
        """A future set once the early ask of ``seq_id`` is answered (or the request ended)."""
        done = self.loop.create_future()
        self._waiters.setdefault(seq_id, []).append(done)
        return done

    def wake(self, seq_id: str) -> None:
        """The early asks of ``seq_id`` are over (loop thread); a waiter cancelled meanwhile (its
        request's stream closed) is passed over."""
        for done in self._waiters.pop(seq_id, []):
            if not done.done():
                done.set_result(None)

    async def _send(self) -> None:
        """Send what is queued (inside the flush lock). With the link not up, bookkeeping waits for
        the sync and early asks are answered "not now" (each asks again when admitted)."""
        with self.lock:
            asks = self.policy.take_asks()
            batch = self.policy.take() if self.link.up else Bookkeeping()
            asked_at, self._asked_at = self._asked_at, None
        tiers = self.tiers.take() if self.link.up else []
        results: list = [None] * len(asks)
        try:
            if batch or tiers:
                await self._send_batch(batch, tiers, asked_at)
            if asks:
                results = await self._send_asks(asks)
                with self.lock:  # refused for their reserve: asked again without it, in place
                    again = self.policy.first.asks_again(asks, results)
                if again:
                    for (i, request), result in zip(again, await self._send_asks([r for _, r in again])):
                        asks[i], results[i] = request, result
        finally:  # cancelled too (an engine call that timed out): every ask taken gets its answer
            if asks:
                self._answered(asks, results)

    async def _send_batch(self, batch: Bookkeeping, tiers: list[TierChange] = (), asked_at: float | None = None) -> None:
        """Send a bookkeeping batch (and tier moves), asked to go at ``asked_at`` (monotonic); one
        that did not reach block_service is queued again."""
        try:
            # bookkeeping of many requests at once: a trace of its own, linked to each request's
            with batch_span("bookkeeping", self._links.take(batch.seq_ids()), {
                "kvfleet.node_id": self.node_id, "kvfleet.num_topups": len(batch.topups),
                "kvfleet.num_commits": len(batch.commits), "kvfleet.num_releases": len(batch.releases),
                "kvfleet.num_drops": len(batch.drops)}):
                await asyncio.wait_for(self._send_bookkeeping(batch, tiers, asked_at), SEND_TIMEOUT_S)
        except BaseException as e:
            if isinstance(e, Exception) and not self.trouble(e):
                log.exception("block_service flush failed (%d commits, %d releases, %d top-ups)",
                              len(batch.commits), len(batch.releases), len(batch.topups))
                return
            with self.lock:  # not sent (or not known to be): the sync sorts it out
                self.policy.requeue(batch)
            self.tiers.requeue(tiers)
            if not isinstance(e, Exception):
                raise

    async def _send_bookkeeping(self, batch: Bookkeeping, tiers: list[TierChange], asked_at: float | None) -> None:
        self.num_rpcs += 1
        sent = time.monotonic()
        result = await self.client.apply(batch.commits, batch.releases, batch.topups, drops=batch.drops,
                                         node_id=self.node_id, tiers=tiers)
        # from the step that asked for it (a flush in flight and the loop's queue included) to the answer
        round_trip = time.monotonic() - (sent if asked_at is None else min(asked_at, sent))
        self.tiers.fold_applied(tiers, result)
        with self.lock:
            self.pace.round_trip(round_trip)  # how early a top-up must go (``AllocatorPolicy.set_topup_lead``)
            refused = self.policy.fold_applied(batch, result)
        for error in refused:  # refused alone: the rest of the batch was applied
            log.warning("block_service refused %s", error.line())
        lost = [error for error in refused if error.code == "NOT_FOUND"]
        if lost:  # block_service does not know a sequence the node holds
            self.trouble(NotFound(lost[-1].line()))

    async def _send_asks(self, asks: list[AllocateRequest]) -> list:
        """block_service's answers to early asks; ``None`` each where it gave none."""
        if not self.link.up:
            return [None] * len(asks)
        try:
            self.num_rpcs += 1
            return await asyncio.wait_for(self.client.allocate_many(asks), ANSWER_TIMEOUT_S)
        except Exception as e:  # e.g. one id already live: each asks again when admitted
            if not self.trouble(e):
                log.warning("early allocation of %d sequences failed: %s", len(asks), e)
            return [None] * len(asks)

    def _answered(self, asks: list[AllocateRequest], results: list) -> None:
        """Fold the answers to early asks and wake their requests. An ask whose answer never came
        (``None``) may have been granted all the same: the node then does not list it, and the
        resync the trouble started releases it."""
        with self.lock:
            send = self.policy.fold_asks(asks, results)
        for request in asks:
            self.wake(request.seq_id)
        if send:  # grants of requests that ended while they were asked for
            self.send_soon()

    async def sync(self, periodic: bool = False) -> SyncOutcome:
        """Make block_service's view of this node equal to the node's (loop thread; ``BlockSync``
        calls it). A periodic sync of an up link sends the queued bookkeeping first, so that what
        the sync releases is only what leaked; after trouble the sync goes first and the queued
        commits and top-ups of live sequences follow. Raises when block_service did not take it."""
        async with self._flush_lock:
            if periodic and self.link.up:
                await self._send()
            with self.lock:  # queued since then: its releases are moot, the rest follows the sync
                batch, live = self.policy.take_for_sync()
            tiers = self.tiers.index_for_sync()  # outside the lock: the node's source takes its own
            try:
                self.num_rpcs += 1
                result = await asyncio.wait_for(self.client.sync_node(self.node_id, *self.pool, live, tiers),
                                                SEND_TIMEOUT_S)
            except BaseException as e:
                with self.lock:
                    self.policy.requeue(batch)
                if isinstance(e, Exception):
                    self.trouble(e)
                raise
            away = self.link.synced(time.monotonic())
            refused = [seq_id for seq_id, _ in result.refused]
            with self.lock:
                resend = self.policy.after_sync(batch, refused)
            if resend:
                await self._send_batch(resend)
        moot = set(batch.releases)
        leaked = [seq_id for seq_id in result.released if seq_id not in moot]
        if periodic:
            self.link.num_reconciled += len(leaked)
        for seq_id, why in result.refused:
            log.warning("node %s: block_service refused to hold %s after a sync: %s", self.node_id, seq_id, why)
        if refused and self.on_refused is not None:
            self.on_refused(refused, f"block_service could not hold this request's blocks on node {self.node_id}")
        return SyncOutcome(result.registered, leaked, list(result.adopted), list(result.updated),
                           list(result.refused), away)
