"""One block_service replica among several (``--etcd``): lead when elected, else follow the leader.

    no leader in etcd ──campaign──▶ won: lead (accept writes) until the lease is lost ──┐
         ▲     │ lost                    or no live node can reach it (step_down.py)      │
         │     ▼                                                                          │
         └── a leader: follow its log (standby) until the stream ends or the key changes ◀┘

A replica started with ``--standby`` campaigns only after it has followed a leader once, so that
an empty replica never wins against one that holds the state. A replica that lost the lease waits
one TTL before it campaigns again (whatever cost it the lease likely still holds; the standby, in
sync, takes over meanwhile); so does one that stepped down because no node could reach it. It keeps
running as a standby of whoever leads next (its records the new leader never had are replaced by
the new leader's snapshot: they were never acknowledged as replicated). A state of another lineage
ends the process (exit 2) with one line: it must not follow, nor lead a fleet that followed another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aetcd

from kvfleet.block_service.durable_mark import MarkWriter, behind, parse_mark, read_mark
from kvfleet.block_service.election import Election
from kvfleet.block_service.follower import Follower, LineageMismatch, close_quietly
from kvfleet.block_service.lineage import ensure_lineage, read_lineage
from kvfleet.block_service.role import Role
from kvfleet.block_service.step_down_watch import StepDownWatch
from kvfleet.core.backoff import Backoff, LogThrottle, error_line
from kvfleet.core.leader import Leader, watch_leader

log = logging.getLogger(__name__)


DRAIN_IDLE_S = 0.5  # a lapsed leader's stream still delivering records is read until this long idle
NODES_UNREACHABLE, LEASE_LOST = "nodes_unreachable", "lease_lost"  # why a lead ended (the metric's reasons)


def _never() -> bool:
    return False


@dataclass(slots=True, frozen=True)
class ReplicaConfig:
    address: str           # this replica's address, as written in the leader key
    state_dir: str
    ttl_s: int             # the leader lease
    standby_first: bool    # --standby: campaign only after following a leader once


class Replica:
    def __init__(self, client: aetcd.Client, role: Role, follower: Follower, config: ReplicaConfig,
                 on_lead: Callable[[], Awaitable[None]], standby_ready: Callable[[], bool] | None = None,
                 on_step_down: Callable[[str], None] | None = None,
                 on_marks: Callable[[Callable[[int], Awaitable[None]] | None], None] | None = None,
                 spare: aetcd.Client | None = None) -> None:
        """``standby_ready``: a standby could take over now (``StandbyAcks.can_take_over``); without
        it the replica never steps down while it holds the lease. ``on_step_down(reason)``: a lead
        ended (``NODES_UNREACHABLE`` or ``LEASE_LOST``), for the metrics. ``on_marks(cover)``: while
        leading, how to wait for a durable mark that covers a change (``MarkWriter.cover``; None
        when the lead ends), for ``StandbyAcks.alone``. ``spare``: a second etcd client the lease
        refreshes take turns on (``Election``)."""
        self.client, self.role, self.follower, self.on_lead = client, role, follower, on_lead
        self.spare = spare
        self.standby_ready, self.on_step_down, self.on_marks = standby_ready, on_step_down, on_marks
        self.address, self.state_dir = config.address, config.state_dir
        self.ttl_s, self.standby_first = config.ttl_s, config.standby_first
        self.leader: Leader | None = None
        self._followed: str | None = None  # the leader last followed (said once, not per retry)
        self.election: Election | None = None
        self._changed = asyncio.Event()
        self._campaign_after = 0.0  # monotonic; a replica that just lost the lease lets the standby go first
        self._behind_said: int | None = None  # the leader's mark last reported as ahead of this state

    async def _watch(self) -> None:
        async for leader in watch_leader(self.client):
            self.leader = leader
            self.role.leader_address = leader.address if leader else None
            self._changed.set()

    async def run(self) -> int:
        """Until cancelled (a stop); returns 2 when this state must not join the fleet."""
        self.role.holds = _never
        watcher = asyncio.create_task(self._watch())
        backoff, throttle = Backoff(first_s=0.1, cap_s=1.0), LogThrottle()
        try:
            while True:
                self._changed.clear()
                leader = self.leader
                try:
                    if leader is None or leader.address == self.address:  # none, or this replica's previous run
                        may = self.follower.followed or (leader is None and await self._may_lead())
                        if leader is None and may and time.monotonic() >= self._campaign_after:
                            if await self._campaign():
                                backoff.reset()
                                continue
                        await self._wait_change(1.0)
                        continue
                    why = await self._follow(leader)
                except LineageMismatch as err:
                    log.error("cannot follow the leader: %s", err)
                    return 2
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # etcd or the leader briefly unreachable
                    why = error_line(e)
                if why and throttle.due():
                    what = f"following the leader at {leader.address}" if leader else "the election in etcd"
                    log.warning("replica at %s: %s failed (%s); trying again", self.address, what, why)
                await self._wait_change(backoff.next())
        finally:
            await close_quietly(watcher)
            if self.election is not None:
                await self.election.resign()

    async def _wait_change(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    async def _follow(self, leader: Leader) -> str | None:
        """Follow ``leader`` until its stream ends or etcd names another; returns why it ended."""
        if leader.address != self._followed:
            self._followed = leader.address
            log.info("standby: following the leader at %s", leader.address)
        follow = asyncio.create_task(self.follower.follow(leader))
        changed = asyncio.create_task(self._changed.wait())
        await asyncio.wait({follow, changed}, return_when=asyncio.FIRST_COMPLETED)
        await close_quietly(changed)
        if not follow.done() and self.leader is None:
            await self._drain(follow)
        if follow.done():
            return follow.result()
        await close_quietly(follow)
        return None

    async def _drain(self, follow: asyncio.Task) -> None:
        """The leader's key is gone (its lease lapsed) while its stream is still open here: the
        records still on their way were written while it led, and may have been acknowledged to
        clients while this standby lagged (out of sync). They are applied before this replica may
        campaign, for as long as they keep coming: the old leader ends the stream once fenced, and
        one that is unreachable stops sending at once (``DRAIN_IDLE_S`` more to a takeover)."""
        start = self.follower.store.lsn
        while not follow.done():
            before = self.follower.store.lsn
            await asyncio.wait({follow}, timeout=DRAIN_IDLE_S)
            if self.follower.store.lsn == before:
                break
        if self.follower.store.lsn > start:
            log.info("standby: applied records %d-%d that the lapsed leader had still to deliver", start,
                     self.follower.store.lsn - 1)

    async def _may_lead(self) -> bool:
        """Before following anyone in this run: with no leader's mark in etcd (a new fleet), the
        replica not started ``--standby``; with one, a replica whose state holds every record the
        mark names (durable_mark.py), so that leading loses none of them."""
        mark = await read_mark(self.client)
        if mark is None:
            return not self.standby_first
        mine, lineage = self.follower.store.durable_lsn, read_lineage(self.state_dir)
        theirs = behind(mark, lineage, mine)
        if theirs is None:
            return True
        if lineage != parse_mark(mark)[0]:  # empty (a new standby), or another history: following says which
            return False
        if self._behind_said != theirs:
            self._behind_said = theirs
            log.error("replica at %s: its state ends at record %d, the last leader acknowledged %d; it will not "
                      "lead (that would lose them) but follows whoever does: start the replica that holds them, "
                      "or restore it from a backup", self.address, mine, theirs)
        return False

    async def _campaign(self) -> bool:
        lineage = ensure_lineage(self.state_dir)
        election = Election(self.client, Leader(self.address, lineage, self.ttl_s), self.ttl_s, spare=self.spare)
        if not await election.campaign():
            return False
        self.election = election
        self.role.holds = election.holds
        log.info("block_service at %s is the leader (lease TTL %d s)", self.address, self.ttl_s)
        writer = MarkWriter(self.client, lineage, lambda: self.follower.store.durable_lsn)
        marks = asyncio.create_task(writer.run(self.ttl_s / 3))
        if self.on_marks is not None:  # changes acknowledged with no standby in sync wait for a mark
            self.on_marks(writer.cover)
        step_down, watch = None, None
        if self.standby_ready is not None:
            step_down = StepDownWatch(self.client, self.address, self.ttl_s, self.standby_ready)
            watch = asyncio.create_task(step_down.until_due())
        try:
            await self.on_lead()
            reason = await self._lead(election, watch)
            if self.on_step_down is not None:
                self.on_step_down(reason)
        finally:
            await close_quietly(watch)
            if step_down is not None:
                await step_down.close()
            await close_quietly(marks)
            if self.on_marks is not None:
                self.on_marks(None)
            self.role.holds = _never
            self.election = None
            self._campaign_after = time.monotonic() + self.ttl_s
            await election.resign()
        return True

    async def _lead(self, election: Election, watch: asyncio.Task | None) -> str:
        """Lead until the lease is lost, or until ``watch`` says no node can reach this replica:
        then resign (``holds()`` False first, the lease revoked after) and follow whoever leads next."""
        lead = asyncio.create_task(election.lead())
        try:
            await asyncio.wait({lead} if watch is None else {lead, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not lead.done() and watch is not None and watch.exception() is None:
                await election.resign()
                await lead
                return NODES_UNREACHABLE
            if not lead.done():  # a bug in the watch: lead on without it, as before it existed
                log.error("replica at %s: the step-down watch failed (%s); leading on without it", self.address,
                          error_line(watch.exception()))
            await lead
            return LEASE_LOST
        finally:
            await close_quietly(lead)
