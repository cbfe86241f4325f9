"""A per-request silence timer for the relay: one timer per request, not one per token. Pure asyncio."""

from __future__ import annotations

import asyncio


class StallWatch:
    """Puts ``stalled`` into ``inbox`` once nothing was ``heard()`` for ``timeout_s`` (noticed within
    a quarter of that), then stops; ``stop()`` ends it early."""

    def __init__(self, inbox: asyncio.Queue, stalled: Exception, timeout_s: float):
        self.loop = asyncio.get_running_loop()
        self.last = self.loop.time()
        self._task = self.loop.create_task(self._watch(inbox, stalled, timeout_s))

    def heard(self) -> None:
        self.last = self.loop.time()

    async def _watch(self, inbox: asyncio.Queue, stalled: Exception, timeout_s: float) -> None:
        while True:
            await asyncio.sleep(max(self.last + timeout_s - self.loop.time(), timeout_s / 4))
            if self.loop.time() - self.last >= timeout_s:
                inbox.put_nowait(stalled)
                return

    def stop(self) -> None:
        self._task.cancel()
