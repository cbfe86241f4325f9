"""What the leader waits for before it answers a change: its standbys' acknowledgements. Pure.

    --sync-standby, a standby in sync:  answer once the change is durable here AND on the standby
    no standby connected:               answer once durable here and named by the durable mark in
                                        etcd (``alone``: durable_mark.py), one WARNING when it starts
    the standby does not ack in time:   it falls out of sync (WARNING): answers stop waiting for it
                                        until it has caught up with where the leader was then (INFO)

Without ``--sync-standby`` nothing waits: a standby follows as fast as it can (async). Waiting
forever for a standby would make it a second single point of failure; not waiting at all would
lose, at a takeover, every change the standby had not received. This is MySQL's semi-synchronous
replication: a change acknowledged while a standby is in sync survives the loss of either replica;
one acknowledged while none is (said in the log) survives the leader's disk only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class StandbyAcks:
    def __init__(self, sync: bool, timeout_s: float, head: Callable[[], int]) -> None:
        self.sync = sync
        self.timeout_s = timeout_s
        self.head = head                      # the leader's durable lsn now
        self.acked: dict[str, int] = {}       # connected standby → records durable on it
        self.in_sync: set[str] = set()        # standbys whose acks answers wait for
        self.catch_up: dict[str, int] = {}    # out of sync: the record it must reach to be in sync again
        self._changed = asyncio.Event()
        self._warned_alone = False
        # while leading with etcd: a change acknowledged with no standby in sync waits for this
        # (durable_mark.MarkWriter.cover): a mark naming it, so no replica without it may lead
        self.alone: Callable[[int], Awaitable[None]] | None = None

    def connect(self, standby: str) -> None:
        self.acked[standby] = 0
        self.catch_up[standby] = self.head()
        log.info("standby %s connected (%s)", standby, "sync" if self.sync else "async")

    def disconnect(self, standby: str) -> None:
        self.acked.pop(standby, None)
        self.catch_up.pop(standby, None)
        if standby in self.in_sync:
            self.in_sync.discard(standby)
            log.warning("standby %s disconnected%s", standby,
                        "; acknowledging changes without a standby until one catches up" if not self.in_sync
                        and self.sync else "")
        self._wake()

    def ack(self, standby: str, lsn: int) -> None:
        """``standby`` holds every record before ``lsn`` durably."""
        if standby not in self.acked:
            return
        self.acked[standby] = max(self.acked[standby], lsn)
        if self.sync and standby not in self.in_sync and lsn >= self.catch_up[standby]:
            self.in_sync.add(standby)
            self._warned_alone = False
            log.info("standby %s is in sync at record %d: changes are acknowledged once it holds them too",
                     standby, lsn)
        self._wake()

    def can_take_over(self) -> bool:
        """A standby is connected and caught up, so that this replica may step down
        (``step_down.py``): with ``--sync-standby`` one in sync; without, one that has acknowledged
        what was durable here when it connected (what came since, its drain applies at a takeover)."""
        if self.sync:
            return bool(self.in_sync)
        return any(lsn >= self.catch_up[standby] for standby, lsn in self.acked.items())

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _held(self, lsn: int) -> bool:
        return any(self.acked.get(s, 0) >= lsn for s in self.in_sync)

    async def wait(self, lsn: int) -> None:
        """Return once the change ending at ``lsn`` may be acknowledged (see the module doc)."""
        if not self.sync:
            return
        if not self.in_sync:
            if not self._warned_alone:
                self._warned_alone = True
                log.warning("--sync-standby: no standby in sync; acknowledging changes once durable here "
                            "(and named by the durable mark in etcd) until one catches up")
            await self._alone(lsn)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while self.in_sync and not self._held(lsn):
            left = deadline - loop.time()
            if left <= 0:
                late = sorted(self.in_sync)
                self.in_sync.clear()
                for standby in late:  # a target that stays put: under load the head never waits for it
                    self.catch_up[standby] = self.head()
                log.warning("standby %s did not acknowledge record %d within %.1f s: acknowledging changes "
                            "without it until it catches up", ", ".join(late), lsn - 1, self.timeout_s)
                await self._alone(lsn)
                return
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                pass

    def wait_alone_for(self, cover: Callable[[int], Awaitable[None]] | None) -> None:
        """What a change acknowledged with no standby in sync waits for (None: nothing)."""
        self.alone = cover

    async def _alone(self, lsn: int) -> None:
        if self.alone is not None:
            await self.alone(lsn)
