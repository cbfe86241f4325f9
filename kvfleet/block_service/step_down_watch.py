"""While this replica leads: the live nodes and their complaints, followed in etcd, weighed by
``step_down.decide`` after every change and every ``CHECK_S`` (the standby's state moves without
one). ``until_due`` returns once the verdict is STEP_DOWN; the replica then resigns
(``Election.resign``: ``holds()`` turns False, then the lease is revoked and the standby campaigns
at once) and only then ``close``s the watches. Resigning is the replica's, not this task's: a task
cancelled as the lead ends must not cut a revocation short.

A STEP_DOWN verdict is confirmed by reading both prefixes from etcd first (at most once every
``CONFIRM_EVERY_S``): the watches' view can be stale (a connection that stalls before the kernel
kills it, ETIMEDOUT over a lossy link, carries no withdrawal of a complaint until the watch lists
again), and a leader must not step down on complaints the nodes have already withdrawn. No answer
within ``CONFIRM_TIMEOUT_S``: it keeps leading, and the next check asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aetcd

from kvfleet.block_service.step_down import COOL_DOWN_TTLS, KEEP, STEP_DOWN, Complaints, decide
from kvfleet.core.etcd_watch import Change, follow_prefix
from kvfleet.core.leader import UNREACHABLE_PREFIX
from kvfleet.core.membership import NODES_PREFIX

log = logging.getLogger(__name__)

CHECK_S = 0.25
CONFIRM_EVERY_S = 1.0    # a stale view asks etcd at most this often
CONFIRM_TIMEOUT_S = 2.0


class StepDownWatch:
    def __init__(self, client: aetcd.Client, address: str, ttl_s: int, standby_ready: Callable[[], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.address, self.standby_ready, self.clock = client, address, standby_ready, clock
        self.cool_down_s = COOL_DOWN_TTLS * ttl_s
        self.complaints = Complaints()
        self._changed = asyncio.Event()
        self._listed: set[str] = set()
        self._follows: list[asyncio.Task] = []

    async def until_due(self) -> str:
        """Until this replica should step down (returns why at once: the etcd watches are ended by
        ``close``, after the resignation); cancelled when its lead ends otherwise."""
        self._follows = [asyncio.create_task(self._follow(NODES_PREFIX, self._node)),
                         asyncio.create_task(self._follow(UNREACHABLE_PREFIX, self._complaint))]
        led_since, said, confirm_after = self.clock(), KEEP, float("-inf")
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), CHECK_S)
            self._changed.clear()
            if len(self._listed) < len(self._follows):
                continue  # a view of half the fleet could read as "every node"
            verdict = decide(self.complaints, self.address, self.standby_ready(), self.clock() - led_since,
                             self.cool_down_s)
            if verdict.action == STEP_DOWN:
                if self.clock() >= confirm_after:
                    confirm_after = self.clock() + CONFIRM_EVERY_S
                    if await self._confirmed(led_since):
                        log.warning("block_service at %s steps down: %s", self.address, verdict.line)
                        return verdict.line
                continue  # the watches' view was stale, or etcd did not answer: not yet
            if verdict.action not in (said, KEEP):
                log.warning("block_service at %s: %s", self.address, verdict.line)
            said = verdict.action

    async def close(self) -> None:
        for task in self._follows:
            task.cancel()
        await asyncio.gather(*self._follows, return_exceptions=True)

    async def _confirmed(self, led_since: float) -> bool:
        """The verdict is STEP_DOWN on the live nodes and their complaints as etcd holds them now
        (False when it does not answer in time)."""
        try:
            nodes, against = await asyncio.wait_for(asyncio.gather(
                self.client.get_prefix(NODES_PREFIX.encode()), self.client.get_prefix(UNREACHABLE_PREFIX.encode())),
                CONFIRM_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            return False
        now = Complaints()
        for kv in nodes:
            now.node(kv.key.decode()[len(NODES_PREFIX):], True)
        for kv in against:
            now.complaint(kv.key.decode()[len(UNREACHABLE_PREFIX):], kv.value.decode(errors="replace"))
        verdict = decide(now, self.address, self.standby_ready(), self.clock() - led_since, self.cool_down_s)
        return verdict.action == STEP_DOWN

    def _node(self, node_id: str, value: bytes | None) -> None:
        self.complaints.node(node_id, value is not None)

    def _complaint(self, node_id: str, value: bytes | None) -> None:
        self.complaints.complaint(node_id, value.decode(errors="replace") if value is not None else None)

    async def _follow(self, prefix: str, apply: Callable[[str, bytes | None], None]) -> None:
        async for change in follow_prefix(self.client, prefix, f"step-down watch {prefix}"):
            if isinstance(change, Change):
                apply(change.key, change.value)
            else:
                self._listed.add(prefix)
            self._changed.set()
