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
  A call's answer is folded into the node's tables inside that lock, so a sync (below) never
  sees block_service hold what the node does not know yet.
- **Write-behind.** ``commit``, ``release`` and ``end_step`` only queue and kick a flush: the
  engine's step never waits on the network for them, and a flush block_service cannot take is
  logged on the loop, never raised into the engine's thread.
- **Never stuck on a peer.** A call that needs an answer waits at most ``ANSWER_TIMEOUT_S``. When
  block_service is unreachable, or answers that it does not know this node or one of its live
  sequences, the link is marked (``BlockLink``) and, until a sync succeeds, such calls answer a
  transient refusal at once (the scheduler waits; nothing is refused) and bookkeeping stays
  queued. ``BlockSync`` retries the sync with backoff.
- **One place to resync.** What block_service should hold for this node is ``live_sequences()``
  (claimed tables and early allocations not yet claimed). ``sync`` sends them (``SyncNode``):
  block_service registers the pool if it lost it, releases what the node no longer has, adopts
  what it does not know; queued commits and top-ups of live sequences follow, queued releases are
  then moot. Sequences block_service refuses to hold are failed in the engine (``on_refused``):
  their routers move them to another node. The same sync runs every ``--reconcile-interval``
  seconds, so a leak of any origin is bounded in time.
- **Lower tiers** (issue 15, ``tier_queue.py``): the node's tier moves go with the step's
  bookkeeping (``ApplyMany``); those block_service refused (the tenant's lower-tier cap) come back
  through ``take_tier_refusals``; a sync sends the node's whole lower-tier index (its source).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from compute_service.blocks.allocator_policy import (
    DEFER_STEPS,
    AllocatorPolicy,
    Bookkeeping,
    LiveSequence,
)
from compute_service.blocks.link import DOWN, BlockLink, trouble_of
from compute_service.blocks.sync import BlockSync, SyncOutcome
from compute_service.blocks.tier_queue import TierQueue, TierSource
from kvfleet import block_hash
from kvfleet.allocator import AllocateRequest, Allocation, AllocatorStats, Refusal, TierChange
from kvfleet.backoff import error_line
from kvfleet.errors import NotFound
from kvfleet.tracing import BatchLinks, batch_span

log = logging.getLogger(__name__)

TraceContextOf = Callable[[str], object]  # seq id → OpenTelemetry context (or None)
T = TypeVar("T")
OnRefused = Callable[[list[str], str], None]  # (seq ids, why) block_service refused to hold after a sync

ANSWER_TIMEOUT_S = 3.0   # the most the engine's step waits for block_service (what was queued, then its answer)
SEND_TIMEOUT_S = 10.0    # the most a bookkeeping batch or a sync may take before the link counts as down


class RemoteBlockAllocator:
    def __init__(self, client, loop: asyncio.AbstractEventLoop, node_id: str, num_blocks: int, block_size: int,
                 trace_context_of: TraceContextOf | None = None, defer_steps: int = DEFER_STEPS,
                 bytes_per_block: int = 0, on_refused: OnRefused | None = None):
        self.client = client
        self.loop = loop
        self.node_id = node_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.trace_context_of = trace_context_of or (lambda seq_id: None)
        self._links = BatchLinks(self.trace_context_of)  # the requests each bookkeeping batch serves
        self.on_refused = on_refused  # set by the node once its engine runs
        self.num_rpcs = 0
        self.link = BlockLink()
        self.syncs = BlockSync(node_id, self.sync)
        self._lock = threading.Lock()               # guards the policy (engine thread and loop)
        self._policy = AllocatorPolicy(block_size, defer_steps)
        self._waiters: dict[str, list[asyncio.Future]] = {}  # seq → preallocations awaiting (loop)
        self._flush_lock = asyncio.Lock()           # one flush at a time, in order (loop thread)
        self._flushes: set[asyncio.Task] = set()    # flushes kicked off and not finished (loop thread)
        self._stats = AllocatorStats(num_blocks, num_blocks, 0, 0, 0, 0)  # the last figures block_service gave
        self._tiers = TierQueue()  # lower-tier moves, refusals, the node's index (issue 15)

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, coro_fn, unavailable: Callable[[], object], seq_id: str | None = None):
        """Run ``coro_fn()`` on the loop under ``seq_id``'s trace context, after everything queued
        before it was sent, inside the flush lock; wait for its result (engine thread). With the
        link not up, or block_service not answering in time, the answer is ``unavailable()``."""
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
                if not self._trouble(e):
                    raise
                return unavailable()
            finally:
                if token is not None:
                    otel_context.detach(token)

        return asyncio.run_coroutine_threadsafe(traced(), self.loop).result()

    async def _send_then(self, coro_fn, unavailable: Callable[[], object]):
        await self._send()
        return await coro_fn() if self.link.up else unavailable()

    def _trouble(self, error: BaseException) -> bool:
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

    def _send_soon(self) -> None:
        """Have the loop flush what is queued, if anything (any thread; returns at once)."""
        with self._lock:
            if not self._policy.has_bookkeeping() and not self._tiers.pending:
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
        """Send what is queued (inside the flush lock). With the link not up, bookkeeping waits for
        the sync and preallocations are answered "not now" (each asks again when admitted)."""
        with self._lock:
            asks = self._policy.take_asks()
            batch = self._policy.take() if self.link.up else Bookkeeping()
        tiers = self._tiers.take() if self.link.up else []
        results: list = [None] * len(asks)
        try:
            if batch or tiers:
                await self._send_batch(batch, tiers)
            if asks:
                results = await self._send_asks(asks)
        finally:  # cancelled too (an engine call that timed out): every ask taken gets its answer
            if asks:
                self._answered(asks, results)

    async def _send_batch(self, batch: Bookkeeping, tiers: list[TierChange] = ()) -> None:
        """Send a bookkeeping batch (and tier moves); one that did not reach block_service is queued again."""
        try:
            # bookkeeping of many requests at once: a trace of its own, linked to each request's
            seq_ids = [s[0] for s in (*batch.topups, *batch.commits, *batch.drops)] + batch.releases
            with batch_span("bookkeeping", self._links.take(seq_ids), {
                "kvfleet.node_id": self.node_id, "kvfleet.num_topups": len(batch.topups),
                "kvfleet.num_commits": len(batch.commits), "kvfleet.num_releases": len(batch.releases),
                "kvfleet.num_drops": len(batch.drops)}):
                await asyncio.wait_for(self._send_bookkeeping(batch, tiers), SEND_TIMEOUT_S)
        except BaseException as e:
            if isinstance(e, Exception) and not self._trouble(e):
                log.exception("block_service flush failed (%d commits, %d releases, %d top-ups)",
                              len(batch.commits), len(batch.releases), len(batch.topups))
                return
            with self._lock:  # not sent (or not known to be): the sync sorts it out
                self._policy.requeue(batch)
            self._tiers.requeue(tiers)
            if not isinstance(e, Exception):
                raise

    async def _send_bookkeeping(self, batch: Bookkeeping, tiers: list[TierChange]) -> None:
        self.num_rpcs += 1
        result = await self.client.apply(batch.commits, batch.releases, batch.topups, drops=batch.drops,
                                         node_id=self.node_id, tiers=tiers)
        # not recorded: the cap refused them, or they were bad (not for a lost node: its sync re-sends)
        self._tiers.refuse(result.tier_refused + [tiers[e.index].block_hash for e in result.errors
                                                  if e.kind == "tier" and e.code != "NOT_FOUND"])
        lost = None
        for error in result.errors:  # refused alone: the rest of the batch was applied
            if error.code == "NOT_FOUND" and error.kind == "release":
                continue  # already gone: what the release wanted
            log.warning("block_service refused %s", error.line())
            if error.code == "NOT_FOUND":
                lost = error
        refused = {error.index for error in result.errors if error.kind == "commit"}
        with self._lock:
            self._policy.fold_topups(batch.topups, result.growth)
            self._policy.fold_commits(batch.commits, refused)
        if lost is not None:  # block_service does not know a sequence the node holds
            self._trouble(NotFound(lost.line()))

    async def _send_asks(self, asks: list[AllocateRequest]) -> list:
        """block_service's answers to early asks; ``None`` each where it gave none."""
        if not self.link.up:
            return [None] * len(asks)
        try:
            self.num_rpcs += 1
            return await asyncio.wait_for(self.client.allocate_many(asks), ANSWER_TIMEOUT_S)
        except Exception as e:  # e.g. one id already live: each asks again when admitted
            if not self._trouble(e):
                log.warning("early allocation of %d sequences failed: %s", len(asks), e)
            return [None] * len(asks)

    def _answered(self, asks: list[AllocateRequest], results: list) -> None:
        """Fold the answers to early asks and wake their requests. An ask whose answer never came
        (``None``) may have been granted all the same: the node then does not list it, and the
        resync the trouble started releases it."""
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
                          share_across_tenants: bool = False, reserve_tokens: int | None = None) -> None:
        """Ask now (event loop) for the blocks the scheduler will ask for when it admits ``seq_id``:
        the same hashes ``KVCacheManager.allocate`` sends (full blocks, the last token's left to
        compute), or with ``reserve_tokens`` (contiguous layout) that many slots and no hashes.
        A refusal is not kept: the scheduler asks again when it admits the request."""
        if not self.link.up:
            return  # the scheduler asks when it admits the request, and waits until block_service is back
        hashes: list[bytes] = []
        if reserve_tokens is None:
            reusable = block_hash.reusable_blocks(len(token_ids), self.block_size)
            hashes = block_hash.block_hashes(token_ids, self.block_size,
                                             block_hash.tenant_extra_key(tenant, share_across_tenants),
                                             max_blocks=reusable)
        done = self.loop.create_future()
        self._waiters.setdefault(seq_id, []).append(done)
        with self._lock:
            first = self._policy.ask(AllocateRequest(self.node_id, seq_id, tenant, hashes,
                                                     reserve_tokens or len(token_ids)))
        if first:
            self.loop.call_soon(self._kick)  # arrivals of this loop iteration go in one call
        try:
            await done
        except asyncio.CancelledError:  # nobody will hand this request to the engine
            self.release([seq_id])
            raise

    def cap_length(self, max_model_len: int) -> None:
        """No sequence grows past ``max_model_len`` tokens (the engine's): no reserve beyond it."""
        with self._lock:
            self._policy.cap_length(max_model_len)

    def live_sequences(self) -> list[LiveSequence]:
        """What block_service holds for this node, as the node knows it (claimed and early)."""
        with self._lock:
            return self._policy.live_sequences()

    # -- sync -------------------------------------------------------------------------------------

    async def sync(self, periodic: bool = False) -> SyncOutcome:
        """Make block_service's view of this node equal to the node's (loop thread; ``BlockSync``
        calls it). A periodic sync of an up link sends the queued bookkeeping first, so that what
        the sync releases is only what leaked; after trouble the sync goes first and the queued
        commits and top-ups of live sequences follow. Raises when block_service did not take it."""
        async with self._flush_lock:
            if periodic and self.link.up:
                await self._send()
            with self._lock:  # queued since then: its releases are moot, the rest follows the sync
                batch, live = self._policy.take_for_sync()
            tiers = self._tiers.index_for_sync()  # outside the lock: the node's source takes its own
            try:
                self.num_rpcs += 1
                result = await asyncio.wait_for(self.client.sync_node(
                    self.node_id, self.num_blocks, self.block_size, self.bytes_per_block, live, tiers),
                    SEND_TIMEOUT_S)
            except BaseException as e:
                with self._lock:
                    self._policy.requeue(batch)
                if isinstance(e, Exception):
                    self._trouble(e)
                raise
            away = self.link.synced(time.monotonic())
            refused = [seq_id for seq_id, _ in result.refused]
            with self._lock:
                resend = self._policy.after_sync(batch, refused)
            if resend:
                await self._send_batch(resend)
        moot = set(batch.releases)
        leaked = [seq_id for seq_id in result.released if seq_id not in moot]
        if periodic:
            self.link.num_reconciled += len(leaked)
        if refused:
            for seq_id, why in result.refused:
                log.warning("node %s: block_service refused to hold %s after a sync: %s", self.node_id, seq_id, why)
            if self.on_refused is not None:
                self.on_refused(refused, f"block_service could not hold this request's blocks on node {self.node_id}")
        return SyncOutcome(result.registered, leaked, list(result.adopted), list(result.updated),
                           list(result.refused), away)

    # -- BlockAllocator ---------------------------------------------------------------------------

    def begin_step(self) -> None:
        with self._lock:
            self._policy.begin_step()

    def end_step(self) -> None:
        """The engine finished a step: send what is queued if it is urgent or due (returns at once)."""
        with self._lock:
            send = self._policy.end_step()
        if send or self._tiers.pending:
            self._send_soon()

    def allocate(self, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int) -> Allocation | Refusal:
        with self._lock:
            early = self._policy.allocate(seq_id, block_hashes, num_tokens)
        if early is not None:
            return early

        async def ask():
            self.num_rpcs += 1
            result = await self.client.allocate(self.node_id, seq_id, tenant, block_hashes, num_tokens)
            if isinstance(result, Allocation):  # claimed inside the flush lock: a sync lists it
                with self._lock:
                    self._policy.claim(seq_id, tenant, result, num_tokens)
            return result

        blocks = -(-num_tokens // self.block_size)
        result = self._call(ask, lambda: Refusal.unavailable(self.node_id, tenant, blocks), seq_id)
        if isinstance(result, Refusal) and result.reason == "pool":
            short = result.blocks_asked - (result.blocks_allowed - result.blocks_charged)
            with self._lock:  # early grants of requests queued behind it give way (sent before the retry)
                given = self._policy.give_back_early(seq_id, short)
            if given:
                result = self._call(ask, lambda: Refusal.unavailable(self.node_id, tenant, blocks), seq_id)
        return result

    def extend(self, growth: Sequence[tuple[str, int]]) -> list[list[int] | Refusal]:
        with self._lock:
            grown = self._policy.extend(growth)
        answers: dict[str, list[int] | Refusal] = dict(grown.answers)
        if grown.short:
            unavailable = {s: Refusal.unavailable(self.node_id) for s, _ in grown.short}
            answers.update(self._call(lambda: self._extend_now(grown.short), lambda: unavailable,
                                      grown.short[0][0]))
        return [answers[seq_id] for seq_id, _ in growth]

    async def _extend_now(self, short: list[tuple[str, int]]) -> dict[str, list[int] | Refusal]:
        """No reserve covers these: ask block_service (after the queue before them was sent)."""
        with self._lock:
            asks = self._policy.extend_asks(short)
        try:
            while asks:
                self.num_rpcs += 1
                results = await self.client.extend(asks)
                with self._lock:
                    asks = self._policy.fold_extend(asks, results)
        except BaseException:  # not answered: nothing is handed (what was granted stays in the tables)
            with self._lock:
                self._policy.abandon_extend()
            raise
        with self._lock:
            return self._policy.hand_over()

    def record_tiers(self, changes: Sequence[TierChange]) -> None:
        """Queued; sent with the step's bookkeeping at ``end_step``."""
        self._tiers.record(changes)

    def take_tier_refusals(self) -> list[bytes]:
        return self._tiers.take_refusals()

    def set_tier_source(self, source: TierSource) -> None:
        """Read at every sync (a resync after trouble, a reconciliation) and sent whole."""
        self._tiers.set_source(source)

    def commit(self, commits: Sequence[tuple[str, int, bytes]]) -> None:
        with self._lock:
            self._policy.commit(commits)

    def drop_front(self, drops: Sequence[tuple[str, int]]) -> None:
        with self._lock:
            self._policy.drop_front(drops)

    def release(self, seq_ids: Sequence[str]) -> None:
        """Give back the sequences' blocks. From the engine (its step thread): whatever it holds.
        On the event loop (a request's stream ended): only what the engine never claimed, an
        early allocation; a claimed sequence may be in the engine's step right now, and the
        engine releases it itself when the request's abort reaches it."""
        on_loop = self._on_loop()
        self._links.hold(seq_ids)  # the request may be gone when its release is sent
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
        """block_service's figures of this pool; the last ones it gave while it cannot answer."""
        async def ask():
            self.num_rpcs += 1
            nodes, _ = await self.client.stats([self.node_id])
            n = nodes[0]
            return AllocatorStats(num_blocks=n.num_blocks, num_free=n.num_free, num_cached=n.num_cached,
                                  num_used=n.num_used, prefix_queries=n.counters.prefix_queries,
                                  prefix_hits=n.counters.prefix_hits)

        self._stats = self._call(ask, lambda: self._stats)
        return self._stats
