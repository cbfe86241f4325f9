"""A node tells etcd when it cannot reach block_service's leader, so that a leader cut off from the
nodes (but not from etcd, which keeps its lease) can step down (``kvfleet.block_service.step_down``).

    every threshold/3: a health check of the leader etcd names, on the node's block_service channel
        (waiting for it to connect, for at most the threshold)
        ─▶ ``LeaderReach`` (leader_reach.py): nothing heard from it for the threshold (TTL/2), and
           two checks in a row went their whole threshold unanswered?
        ─▶ yes: put /kvfleet/block_service/unreachable/<node_id> = its address, under the node's lease
           no:  delete that key (once)
    weighed again at each check and whenever one goes unanswered

The key lives under the node's own lease: a node that dies takes its complaint with it, and a node
that etcd cannot hear from cannot complain (it is not a live node then either). A complaint names
the leader it is about; it is withdrawn once that leader answers or etcd names another. A node that
is idle probes all the same: the leader counts every live node, and a quiet one must not hold a
cut-off leader in place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aetcd

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.compute_service.blocks.leader_reach import MIN_THRESHOLD_S, PROBES_PER_THRESHOLD, LeaderReach, threshold_for
from kvfleet.compute_service.blocks.link import DOWN, trouble_of
from kvfleet.core.backoff import LogThrottle, error_line
from kvfleet.core.leader import Leader, unreachable_key, watch_leader

log = logging.getLogger(__name__)

_UNKNOWN = ("?", None)    # what etcd holds at the start: a previous run's complaint is deleted first


class LeaderComplaint:
    def __init__(self, node_id: str, etcd: aetcd.Client, blocks: BlockManagerClient,
                 lease: Callable[[], int | None], clock: Callable[[], float] = time.monotonic) -> None:
        self.node_id, self.etcd, self.blocks, self.lease, self.clock = node_id, etcd, blocks, lease, clock
        self.key = unreachable_key(node_id)
        self.leader: Leader | None = None
        self.reach = LeaderReach()
        self._said: tuple[str | None, int | None] = _UNKNOWN  # (complaint, lease) as etcd holds it
        self._throttle = LogThrottle()
        self._denied_said = False
        self._tasks: list[asyncio.Task] = []
        self._probes: set[asyncio.Task] = set()  # in flight, each given the threshold to answer
        self._saying = asyncio.Lock()            # one ``_say`` at a time: the ticks' and the probes'

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._follow_leader(), name=f"leader-{self.node_id}"),
                       asyncio.create_task(self._tick_every(), name=f"leader-probe-{self.node_id}")]

    async def close(self) -> None:
        """Stop probing; the complaint, if any, goes with the node's lease."""
        tasks = [*self._tasks, *self._probes]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow_leader(self) -> None:
        async for leader in watch_leader(self.etcd):
            self.leader = leader

    async def _tick_every(self) -> None:
        while True:
            started = self.clock()
            every = await self.tick()
            await asyncio.sleep(max(every - (self.clock() - started), 0.0))

    async def tick(self) -> float:
        """Say what the probes so far make this node say, and send the next probe (it answers in
        the background, within the threshold); returns the time to the next tick."""
        leader = self.leader
        if leader is not None and not leader.ttl_s:
            leader = None  # a replica older than step-downs: it would not listen
        address = leader.address if leader is not None else None
        threshold = threshold_for(leader.ttl_s) if leader is not None else MIN_THRESHOLD_S
        self.reach.follow(address, threshold, self.clock())
        await self._say_now()
        if address is not None and self.blocks.target == address:  # the client follows etcd too
            number = self.reach.sent(address)
            probe = asyncio.create_task(self._probe(address, number, threshold))
            self._probes.add(probe)
            probe.add_done_callback(self._probes.discard)
        return threshold / PROBES_PER_THRESHOLD

    async def _probe(self, address: str, number: int, timeout_s: float) -> None:
        try:
            await self.blocks.ping(timeout_s, wait_for_ready=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if trouble_of(e) == DOWN:
                if _went_its_whole_time(e):
                    self.reach.expired(address, number)
                    await self._say_now()
                return  # cut short (its connection broke under it): no evidence either way
            # any other error is an answer: it is reachable
        self.reach.answered(address, number, self.clock())

    async def _say_now(self) -> None:
        async with self._saying:
            await self._say(self.reach.complaint(self.clock()))

    async def _say(self, complaint: str | None) -> None:
        """Make etcd hold ``complaint`` (None: no key), tied to the node's current lease."""
        lease = self.lease() if complaint is not None else None
        if complaint is not None and lease is None:
            return  # not registered (yet, or again): a complaint must not outlive the node
        if (complaint, lease) == self._said:
            return
        try:
            if complaint is None:
                await self.etcd.delete(self.key)
            else:
                await self.etcd.put(self.key, complaint.encode(), lease=lease)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # etcd unreachable: said at the next probe, if still true
            line = error_line(e)
            if "permission denied" in line:  # etcd's roles predate the key: once, with the fix
                if not self._denied_said:
                    self._denied_said = True
                    log.error("node %s: etcd refuses its key %s (permission denied): run `kvfleet etcd-auth` "
                              "again so that it may say when it cannot reach the block_service leader",
                              self.node_id, self.key.decode())
            elif self._throttle.due():
                log.warning("node %s: cannot tell etcd whether it reaches the block_service leader: %s",
                            self.node_id, line)
            return
        before, self._said = self._said[0], (complaint, lease)
        if complaint is not None and before != complaint:
            log.warning("node %s: the block_service leader at %s has not answered for %.1f s; said so in etcd "
                        "(it steps down when no live node reaches it)", self.node_id, complaint,
                        self.clock() - self.reach.heard_at)
        elif complaint is None and before not in (None, _UNKNOWN[0]):
            log.info("node %s: withdrew its complaint about the block_service leader at %s", self.node_id, before)


def _went_its_whole_time(error: BaseException) -> bool:
    """A probe that failed for its deadline (not one its broken connection cut short)."""
    if isinstance(error, TimeoutError):
        return True
    code = getattr(error, "code", None)
    return callable(code) and getattr(code(), "name", None) == "DEADLINE_EXCEEDED"
