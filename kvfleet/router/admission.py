"""Waiting for a turn: the asyncio side of ``PriorityQueue``.

Each request awaits ``wait()`` and calls ``finish()`` when done; whenever a slot may have opened
(a request was queued or finished) the queue is drained as far as its limits allow and the chosen
waiters wake. A waiter shed from a full queue gets ``Shed``; a waiter whose caller went away is
taken out of the queue, or, when it is dispatched in the instant its caller leaves, its slot is
given back at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from kvfleet.router.priority_queue import PriorityQueue, QueuedRequest


class Shed(Exception):
    """The queue was full and this request scored lowest (→ RESOURCE_EXHAUSTED)."""


class Admission:
    def __init__(self, queue: PriorityQueue, clock: Callable[[], float] = time.monotonic):
        self.queue = queue
        self.clock = clock

    def _dispatch(self) -> None:
        now = self.clock()
        while (item := self.queue.pop(now)) is not None:
            if item.payload.done():  # its caller left in this same instant: the slot goes back
                self.queue.finish(item.tenant)
                continue
            item.payload.set_result(None)

    async def wait(self, request_id: str, tenant: str, paid: float) -> None:
        """Return when this request may run; call ``finish(tenant)`` when it is done."""
        now = self.clock()
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        shed = self.queue.push(QueuedRequest(request_id, tenant, paid, now, waiter), now)
        if shed is not None and not shed.payload.done():  # a shed waiter that left needs no answer
            shed.payload.set_exception(
                Shed(f"router queue is full ({self.queue.max_size} requests waiting); "
                     f"request {shed.request_id} of tenant {shed.tenant!r} was shed, retry later")
            )
        self._dispatch()
        try:
            await waiter
        except asyncio.CancelledError:
            if self.queue.remove(request_id) is None and waiter.done() and not waiter.cancelled() \
                    and waiter.exception() is None:
                self.finish(tenant)  # popped in the same instant the caller left: give the slot back
            raise

    def finish(self, tenant: str) -> None:
        self.queue.finish(tenant)
        self._dispatch()

    def set_capacity(self, capacity: int | None) -> None:
        """The fleet's capacity changed (a node came, went, or moved its live cap): a raised one
        lets waiters run at once."""
        if capacity != self.queue.capacity:
            self.queue.set_capacity(capacity)
            self._dispatch()
