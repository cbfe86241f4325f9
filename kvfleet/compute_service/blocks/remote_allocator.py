"""``BlockAllocator`` served by block_service over gRPC, kept off the engine's critical path.

The engine calls the allocator synchronously from its step thread; the block_service client is
asyncio, on the node's event loop. Three parts, one job each:

    AllocatorPolicy (allocator_policy.py, pure)  what the node's tables answer, what is sent when
    BlockSender     (sender.py, loop)            sends it in order, folds the answers, syncs
    RemoteBlockAllocator (here)                  the engine's calls and a request's, under one lock

    event loop:    preallocate ─ask─┐                      flush: ApplyMany (top-ups, commits, releases), AllocateMany
                   release_unclaimed │
    engine thread: allocate (answered) │ extend (reserve) │ commit, release ─queue─▶ end_step ─kick─┘

- **Write-behind.** ``commit``, ``release`` and ``end_step`` only queue and kick a flush: the
  engine's step never waits on the network for them.
- **Two releases.** ``release`` is the engine's (its step thread): whatever the sequences hold.
  ``release_unclaimed`` is a request's stream ending (the event loop): only what the engine never
  claimed; a claimed sequence may be in the engine's step right now, and the engine releases it
  itself when the request's abort reaches it.
- **One place to resync.** What block_service should hold for this node is ``live_sequences()``;
  ``sync`` sends them. Sequences block_service refuses to hold are failed in the engine
  (``on_refused``): their routers move them to another node.
- **Lower tiers** (``tier_queue.py``): the node's tier moves go with the step's bookkeeping; those
  block_service refused come back through ``take_tier_refusals``; a sync sends the node's whole
  lower-tier index.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

from kvfleet.compute_service.blocks.allocator_policy import DEFER_STEPS, AllocatorPolicy
from kvfleet.compute_service.blocks.link import BlockLink
from kvfleet.compute_service.blocks.sender import BlockSender, OnRefused, TraceContextOf
from kvfleet.compute_service.blocks.sync import BlockSync, SyncOutcome
from kvfleet.compute_service.blocks.tier_queue import TierQueue, TierSource
from kvfleet.core import block_hash
from kvfleet.core.allocator import AllocateRequest, Allocation, AllocatorStats, LiveSequence, Refusal, TierChange


class RemoteBlockAllocator:
    def __init__(self, client, loop: asyncio.AbstractEventLoop, node_id: str, num_blocks: int, block_size: int,
                 trace_context_of: TraceContextOf | None = None, defer_steps: int = DEFER_STEPS,
                 bytes_per_block: int = 0, on_refused: OnRefused | None = None):
        self.client = client
        self.loop = loop
        self.node_id = node_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()               # guards the policy (engine thread and loop)
        self._policy = AllocatorPolicy(block_size, defer_steps)
        self._tiers = TierQueue()
        self._sender = BlockSender(client, loop, node_id, (num_blocks, block_size, bytes_per_block), self._policy,
                                   self._lock, self._tiers, trace_context_of or (lambda seq_id: None))
        self._sender.on_refused = on_refused
        self.link: BlockLink = self._sender.link      # the sender's, read by the node (never replaced)
        self.syncs: BlockSync = self._sender.syncs
        self._stats = AllocatorStats(num_blocks, num_blocks, 0, 0, 0, 0)  # the last figures block_service gave
        # calls the engine's step waited on block_service for: its own first allocations (no early
        # grant fitted) and extends no reserve in the table covered (kvfleet:node_block_sync_calls)
        self.num_sync_allocates = 0
        self.num_sync_extends = 0
        self._step_began: tuple[float, int] | None = None  # (monotonic, sync calls so far) at begin_step

    # -- what the node reads and sets -------------------------------------------------------------

    @property
    def num_rpcs(self) -> int:
        return self._sender.num_rpcs

    @property
    def on_refused(self) -> OnRefused | None:
        return self._sender.on_refused

    @on_refused.setter
    def on_refused(self, on_refused: OnRefused | None) -> None:
        self._sender.on_refused = on_refused

    @property
    def trace_context_of(self) -> TraceContextOf:
        """seq id → the request's trace context: block_service calls made for it join its trace."""
        return self._sender.trace_context_of

    @trace_context_of.setter
    def trace_context_of(self, context_of: TraceContextOf) -> None:
        self._sender.trace_context_of = context_of

    async def flush(self) -> None:
        """Send what is queued, after any flush in flight (loop thread)."""
        await self._sender.flush()

    async def settle(self) -> None:
        """Return once the flushes kicked off so far have finished (loop thread): what the engine
        queued before is then applied at block_service, and what was deferred is still queued."""
        await self._sender.settle()

    async def sync(self, periodic: bool = False) -> SyncOutcome:
        """Make block_service's view of this node equal to the node's (``BlockSender.sync``)."""
        return await self._sender.sync(periodic)

    def cap_length(self, max_model_len: int) -> None:
        """No sequence grows past ``max_model_len`` tokens (the engine's): no reserve beyond it."""
        with self._lock:
            self._policy.cap_length(max_model_len)

    def live_sequences(self) -> list[LiveSequence]:
        """What block_service holds for this node, as the node knows it (claimed and early)."""
        with self._lock:
            return self._policy.live_sequences()

    # -- a request's calls (event loop) -----------------------------------------------------------

    async def preallocate(self, seq_id: str, tenant: str, token_ids: list[int],
                          share_across_tenants: bool = False, reserve_tokens: int | None = None,
                          prefix_group: str = "") -> None:
        """Ask now for the blocks the scheduler will ask for when it admits ``seq_id``: the same
        hashes ``KVCacheManager.allocate`` sends (full blocks, the last token's left to compute),
        or with ``reserve_tokens`` (contiguous layout) that many slots and no hashes. A refusal is
        not kept: the scheduler asks again when it admits the request."""
        if not self.link.up:
            return  # the scheduler asks when it admits the request, and waits until block_service is back
        hashes: list[bytes] = []
        if reserve_tokens is None:
            reusable = block_hash.reusable_blocks(len(token_ids), self.block_size)
            hashes = block_hash.block_hashes(token_ids, self.block_size,
                                             block_hash.tenant_extra_key(tenant, share_across_tenants, prefix_group),
                                             max_blocks=reusable)
        done = self._sender.waiter(seq_id)
        with self._lock:
            first = self._policy.ask(AllocateRequest(self.node_id, seq_id, tenant, hashes,
                                                     reserve_tokens or len(token_ids)))
        if first:
            self.loop.call_soon(self._sender.kick)  # arrivals of this loop iteration go in one call
        try:
            await done
        except asyncio.CancelledError:  # nobody will hand this request to the engine
            self.release_unclaimed([seq_id])
            raise

    def release_unclaimed(self, seq_ids: Sequence[str]) -> None:
        """The requests' streams ended (event loop): give back what the engine never claimed (an
        early allocation, asked, in flight or granted); a preallocation waiting is woken."""
        self._sender.hold_links(seq_ids)  # the request may be gone when its release is sent
        with self._lock:
            send = self._policy.release_unclaimed(seq_ids)
        for seq_id in seq_ids:
            self._sender.wake(seq_id)
        if send:
            self._sender.send_soon()

    # -- BlockAllocator (the engine's step thread) ------------------------------------------------

    def begin_step(self) -> None:
        self._step_began = (time.monotonic(), self.num_sync_allocates + self.num_sync_extends)
        with self._lock:
            self._policy.begin_step()

    def end_step(self) -> None:
        """The engine finished a step: send what is queued if it is urgent or due (returns at once).
        The step's time paces the top-ups (a step that waited on block_service is not the engine's pace)."""
        began, self._step_began, now = self._step_began, None, time.monotonic()
        with self._lock:
            if began is not None and began[1] == self.num_sync_allocates + self.num_sync_extends:
                self._sender.pace.step(now - began[0])
                self._policy.set_topup_lead(self._sender.pace.lead_steps())
            send = self._policy.end_step()
        if send or self._tiers.pending:
            self._sender.send_soon()

    def allocate(self, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int) -> Allocation | Refusal:
        with self._lock:
            early = self._policy.allocate(seq_id, block_hashes, num_tokens)
            asked = self._policy.first.ask_tokens(block_hashes, num_tokens)  # through the reserve block
        if early is not None:
            return early

        async def ask():
            self._sender.num_rpcs += 1
            self.num_sync_allocates += 1
            result = await self.client.allocate(self.node_id, seq_id, tenant, block_hashes, asked)
            if isinstance(result, Allocation):  # claimed inside the flush lock: a sync lists it
                with self._lock:
                    return self._policy.claim(seq_id, tenant, result, num_tokens, asked)
            return result

        def unavailable() -> Refusal:
            return Refusal.unavailable(self.node_id, tenant, -(-num_tokens // self.block_size))

        result = self._sender.answer(ask, unavailable, seq_id)
        plain = self._policy.first.without_reserve(num_tokens, asked, result) if isinstance(result, Refusal) else None
        if plain is not None:  # the reserve made it not fit: the blocks alone (a top-up brings it later)
            asked = plain
            result = self._sender.answer(ask, unavailable, seq_id)
        if isinstance(result, Refusal):
            with self._lock:  # early grants of requests queued behind it give way (sent before the retry)
                given = self._policy.give_back_early(seq_id, result)
            if given:
                asked = num_tokens  # what they free may not cover a reserve: the blocks alone
                result = self._sender.answer(ask, unavailable, seq_id)
        return result

    def extend(self, growth: Sequence[tuple[str, int]]) -> list[list[int] | Refusal]:
        with self._lock:
            grown = self._policy.extend(growth)
        answers: dict[str, list[int] | Refusal] = dict(grown.answers)
        if grown.short:
            self.num_sync_extends += 1  # the step waits on the loop: a flush in flight, or block_service
            unavailable = {s: Refusal.unavailable(self.node_id) for s, _ in grown.short}
            answers.update(self._sender.answer(lambda: self._extend_now(grown.short), lambda: unavailable,
                                               grown.short[0][0]))
        return [answers[seq_id] for seq_id, _ in growth]

    async def _extend_now(self, short: list[tuple[str, int]]) -> dict[str, list[int] | Refusal]:
        """No reserve covers these: ask block_service (after the queue before them was sent)."""
        with self._lock:
            asks = self._policy.extend_asks(short)
        try:
            while asks:
                self._sender.num_rpcs += 1
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
        """The engine is done with these sequences: give back whatever they hold."""
        self._sender.hold_links(seq_ids)  # the request may be gone when its release is sent
        with self._lock:
            send = self._policy.release(seq_ids)
        if send:  # during a step (the engine thread finishing it) end_step sends it
            self._sender.send_soon()

    def stats(self) -> AllocatorStats:
        """block_service's figures of this pool; the last ones it gave while it cannot answer."""
        async def ask():
            self._sender.num_rpcs += 1
            nodes, _ = await self.client.stats([self.node_id])
            n = nodes[0]
            return AllocatorStats(num_blocks=n.num_blocks, num_free=n.num_free, num_cached=n.num_cached,
                                  num_used=n.num_used, prefix_queries=n.counters.prefix_queries,
                                  prefix_hits=n.counters.prefix_hits)

        self._stats = self._sender.answer(ask, lambda: self._stats)
        return self._stats
