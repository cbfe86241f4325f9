"""The node's side of keeping block_service's view of it true: one resync after trouble, with
backoff, and a reconciliation every so often.

    trouble (block_service down, or it lost this node) ──▶ resync task: sync, sleep 0.2 s, 0.4 s ... 5 s, sync ...
    every ``interval_s`` while the link is up ─────────────▶ sync (what block_service releases was a leak)

Both call the remote allocator's ``sync`` (one ``SyncNode`` with the node's live sequences, under
its flush lock, so it is ordered with every other call of the node). The outcome is reported here
in one line: an outage's end at INFO, a reconciliation that found something at WARNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvfleet.compute_service.blocks.link import trouble_of
from kvfleet.core.backoff import Backoff, LogThrottle, error_line

log = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 30.0


@dataclass(slots=True)
class SyncOutcome:
    """What one sync changed at block_service, and how long the link had been away (0: it was up)."""

    registered: bool = False      # block_service did not have the pool (any more): registered again
    released: list[str] = field(default_factory=list)
    adopted: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    away_s: float = 0.0

    def counts(self) -> str:
        counts = (f"released {len(self.released)}, adopted {len(self.adopted)}, "
                  f"updated {len(self.updated)}, refused {len(self.refused)}")
        return ("pool registered again, " if self.registered else "") + counts


Sync = Callable[[bool], Awaitable[SyncOutcome]]  # periodic → outcome; raises when it did not happen


class BlockSync:
    """Runs the syncs of one node (loop thread). ``trouble()`` starts the resync if none runs."""

    def __init__(self, node_id: str, sync: Sync, backoff: Callable[[], Backoff] = Backoff,
                 throttle_s: float = 5.0):
        self.node_id = node_id
        self._sync = sync
        self._backoff = backoff
        self._throttle_s = throttle_s
        self._resync: asyncio.Task | None = None
        self._reconciler: asyncio.Task | None = None
        self._closed = False
        self._retry_now = asyncio.Event()

    def trouble(self) -> None:
        if self._closed:
            return
        if self._resync is None or self._resync.done():
            self._resync = asyncio.get_running_loop().create_task(self._resync_until_done(),
                                                                  name=f"resync-{self.node_id}")

    def retry_now(self) -> None:
        """Cut the resync's current backoff short (block_service's leader changed: the new one
        answers now, not at the next backoff step)."""
        self._retry_now.set()

    @property
    def resyncing(self) -> bool:
        return self._resync is not None and not self._resync.done()

    def start_reconciling(self, interval_s: float = RECONCILE_INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"reconcile interval must be positive, got {interval_s}")
        self._reconciler = asyncio.get_running_loop().create_task(self._reconcile_every(interval_s),
                                                                  name=f"reconcile-{self.node_id}")

    async def close(self) -> None:
        self._closed = True
        for task in (self._resync, self._reconciler):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _resync_until_done(self) -> None:
        backoff, throttle = self._backoff(), LogThrottle(self._throttle_s)
        # not ``while True``: Python 3.11's ``asyncio.wait_for`` can lose a cancel that races its
        # inner wait (fixed in 3.12); ``close`` must not wait on this loop for ever if it does
        while not self._closed:
            self._retry_now.clear()  # a nudge during this try makes the next one start at once
            try:
                outcome = await self._sync(False)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if trouble_of(e) is None:
                    log.exception("node %s: resync with block_service failed", self.node_id)
                elif throttle.due():
                    log.warning("node %s: block_service not back yet (%s); retrying", self.node_id, error_line(e))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._retry_now.wait(), backoff.next())
                continue
            log.info("node %s: block_service resynced after %.1fs: %s", self.node_id, outcome.away_s,
                     outcome.counts())
            return

    async def _reconcile_every(self, interval_s: float) -> None:
        while not self._closed:
            await asyncio.sleep(interval_s)
            if self.resyncing:
                continue  # the resync is the reconciliation
            try:
                outcome = await self._sync(True)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the allocator marked the link and started the resync if it was the link
                if trouble_of(e) is None:
                    log.exception("node %s: reconciliation with block_service failed", self.node_id)
                continue
            if outcome.registered or outcome.released or outcome.adopted or outcome.updated or outcome.refused:
                log.warning("node %s: reconciliation with block_service %s (released: %s)", self.node_id,
                            outcome.counts(), ", ".join(outcome.released[:10]))
