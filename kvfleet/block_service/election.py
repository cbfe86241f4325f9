"""Leadership among block_service replicas: an etcd lease and a key created only if absent.

    campaign: grant a lease (TTL) ─▶ txn(if create_revision(key) == 0: put(key, me, lease)) ─▶ won / lost
    lead:     refresh the lease TTL/6 after the last success was sent, the key read in the same
              round trip; each success moves the fence to (sent + TTL/2); a refresh not answered
              within TTL/6 is sent again beside it, and every try runs until the fence (the first
              answer counts); one that fails is tried again at once, so a moment without an answer
              (etcd electing its raft leader, a member that hangs and is left for the next) or a
              slow one (a 0.4-0.6 s round trip with loss) costs tries, not leadership, while TTL/3
              remains. Tries used to be cut at half the time left to the fence: over the lossy
              soak's link one slow answer was cut at TTL/6, and the tries after it, given less than
              a round trip, could never succeed (a leader fenced every ~10 s at TTL 5)
    fence:    past it: no write is accepted (``holds()`` False); the tries go on until the lease can
              have lapsed in etcd (TTL after the last success was sent): one answered meanwhile proves
              the lease never lapsed (etcd renews no expired lease) and the key still this replica's,
              so the same term goes on with the fence moved past now. Ending the term at the fence
              cost a takeover (~4 s at TTL 3) for every answer late by a moment: over the lossy
              soak's link a reconnect (TLS through the lossy link), or a campaign that took 0.9 s
              with its first refresh due 0.6 s after winning
    lapse:    past it, or the lease or the key gone: not the leader any more; the standby may campaign
    spare:    with a second client (a connection of its own, carrying nothing else), each try goes on
              both and the first answer counts: a stall of one connection (the kernel giving it up,
              ETIMEDOUT, then a TLS reconnect across the lossy link: > TTL at TTL 3) costs no try
    watch:    the key deleted or taken (an operator revoked the lease): not the leader from that event on;
              a watch that breaks is made again from the last revision it saw, for the whole term

Split brain is impossible by construction: only the key's holder accepts writes, and etcd hands
the key to another replica only once the holder's lease has lapsed, which is at least TTL after the
holder last sent a refresh that succeeded. The holder stops accepting writes TTL/2 after that send
(``holds()``), so it has stopped well before anyone else can start, even when etcd is unreachable
from it and it cannot tell. A clean stop revokes the lease: the standby takes over at once. A lease
revoked by hand (``etcdctl lease revoke``) is the one case timing cannot cover: the holder stops at
the key's delete event (milliseconds, the watch below), while the next replica needs a campaign.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aetcd

from kvfleet.core.backoff import LogThrottle, error_line
from kvfleet.core.leader import LEADER_KEY, Leader

log = logging.getLogger(__name__)
RETRY_PAUSE_S = 0.05  # between tries of a refresh that failed
MAX_TRIES = 4         # refreshes in flight at once (each lives until the fence, or its answer)
WATCH_RETRY_S = 0.5   # between a broken watch of the key and the next


class Election:
    def __init__(self, client: aetcd.Client, me: Leader, ttl_s: int = 5, key: str = LEADER_KEY,
                 clock: Callable[[], float] = time.monotonic, spare: aetcd.Client | None = None) -> None:
        if ttl_s < 2:
            raise ValueError(f"the leader lease needs a TTL of at least 2 s, got {ttl_s}")
        self.client = client
        self.refreshers = (client,) if spare is None else (client, spare)  # each try goes on every one
        self.me = me
        self.ttl_s = ttl_s
        self.key = key.encode()
        self.clock = clock
        self.lease_id: int | None = None
        self._fence_at = 0.0   # monotonic time after which this replica must not accept writes
        self._lapse_at = 0.0   # the earliest the lease can have lapsed in etcd: leadership ends there
        self._lost = asyncio.Event()
        self._revision = 0      # the etcd revision at which this replica took the key
        self._why = ""

    def holds(self) -> bool:
        """This replica leads now and may accept a write."""
        return self.lease_id is not None and not self._lost.is_set() and self.clock() < self._fence_at

    async def campaign(self) -> bool:
        """One attempt to take the key; True when this replica now leads."""
        sent = self.clock()
        lease = await self.client.lease(self.ttl_s)
        won, responses = await self.client.transaction(
            compare=[self.client.transactions.create(self.key) == 0],
            success=[self.client.transactions.put(self.key, self.me.to_json(), lease=lease.id)],
            failure=[],
        )
        if not won:
            with contextlib.suppress(Exception):
                await self.client.revoke_lease(lease.id)
            return False
        self.lease_id, self._fence_at, self._lapse_at = lease.id, sent + self.ttl_s / 2, sent + self.ttl_s
        self._revision = responses[0].response_put.header.revision
        self._lost = asyncio.Event()
        return True

    async def lead(self) -> str:
        """Keep the lease while it can; returns why leadership ended (the fence has passed or the
        key is gone: ``holds()`` is False from then on)."""
        watcher = asyncio.create_task(self._watch_key())
        try:
            return await self._refresh()
        finally:
            watcher.cancel()
            await asyncio.wait({watcher}, timeout=5.0)  # never hang a step-down on etcd

    async def _watch_key(self) -> None:
        """Lose at once when the key is deleted or rewritten after this replica took it. A watch
        that breaks (its connection killed, ETIMEDOUT over a lossy link, and made again) is made
        again from the revision after the last it saw, for the whole term: etcd replays what
        happened meanwhile. It used to end for good at the first break: the key's delete was then
        seen only by the next refresh's read of it. Meanwhile the refresh loop and the fence decide."""
        lease, seen = self.lease_id, self._revision
        throttle = LogThrottle()
        while not self._lost.is_set():
            try:
                watch = await self.client.watch(self.key, start_revision=seen + 1)
                try:
                    async for event in watch:
                        seen = max(seen, event.kv.mod_revision)
                        if event.kind == aetcd.EventKind.DELETE or event.kv.lease != lease:
                            self._lose("the leader key was deleted or taken")
                            return
                finally:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(watch.cancel(), WATCH_RETRY_S)
            except asyncio.CancelledError:
                raise
            except aetcd.exceptions.RevisionCompactedError as e:  # the refreshes' reads cover the gap
                seen = max(seen, e.compacted_revision - 1)
            except Exception as e:
                if throttle.due():
                    log.warning("block_service at %s: the watch of the leader key broke (%s); making it again "
                                "from revision %d", self.me.address, error_line(e), seen + 1)
            await asyncio.sleep(WATCH_RETRY_S)

    async def _refresh(self) -> str:
        interval = self.ttl_s / 6
        tries: dict[asyncio.Task, float] = {}  # refreshes in flight → when each was sent
        failing = False  # the last try failed: the next one comes at once
        fenced = False   # past the fence with no answer since: said once, and again when one comes
        try:
            while True:
                # TTL/6 after the last success was sent, not after it came back: a campaign that took
                # 1.3 s over a slow link left its first refresh 0.2 s to the fence (fenced 1.2 s after winning)
                now = self.clock()
                deadline = self._lapse_at if fenced else self._fence_at
                if len(tries) >= MAX_TRIES:
                    next_at = deadline  # until one of them answers
                elif failing:
                    next_at = now + RETRY_PAUSE_S
                elif tries:  # none answered yet: another beside them TTL/6 after the last was sent
                    next_at = max(tries.values()) + interval
                else:
                    next_at = self._fence_at - self.ttl_s / 2 + interval
                wait = max(min(next_at, deadline) - now, 0.0)
                for task in await self._first_of(tries, wait):
                    if task not in tries:  # cancelled: an answer to a later try came first
                        continue
                    sent = tries.pop(task)
                    try:
                        reply, current = task.result()
                    except Exception as e:  # etcd unreachable: the fence decides
                        if not failing:  # the first of a run of failed tries: one line, not one per try
                            log.warning("leader lease refresh failed (%s); trying again until one succeeds or "
                                        "the fence in %.1f s", error_line(e), max(self._fence_at - self.clock(), 0.0))
                        failing = True
                        continue
                    if reply is None or reply.TTL <= 0:
                        return self._lose("the lease expired")
                    if current is None or current.lease != self.lease_id:
                        return self._lose("the leader key was deleted or taken")
                    # the lease was alive when this try reached etcd (an expired one is never renewed)
                    self._fence_at = max(self._fence_at, sent + self.ttl_s / 2)
                    self._lapse_at = max(self._lapse_at, sent + self.ttl_s)
                    failing = False
                    if fenced and self.clock() < self._fence_at:
                        fenced = False
                        log.warning("block_service at %s: a lease refresh succeeded again before the lease could "
                                    "lapse; accepting writes again (the same term)", self.me.address)
                    for older in [t for t, at in tries.items() if at <= sent]:  # answered by this one
                        del tries[older]
                        older.cancel()
                if self._lost.is_set():
                    return self._why
                if self.clock() >= self._lapse_at:
                    return self._lose(f"no lease refresh succeeded for {self.ttl_s} s (TTL): the lease may have "
                                      f"lapsed")
                if not fenced and self.clock() >= self._fence_at:
                    fenced = True
                    log.warning("block_service at %s: no lease refresh succeeded for %.1f s (TTL/2); accepting no "
                                "writes until one does, or the lease can have lapsed in %.1f s", self.me.address,
                                self.ttl_s / 2, max(self._lapse_at - self.clock(), 0.0))
                if self.clock() >= next_at - 1e-9 and len(tries) < MAX_TRIES:
                    # the refresh and the key's check together: one round trip, not two (a 0.5 s RTT
                    # link took > TTL/6 for the pair, and every try ran out: 17 fences in 90 s at TTL 3)
                    failing = False
                    tries[asyncio.ensure_future(self._first_answer())] = self.clock()
        finally:
            for task in tries:
                task.cancel()

    async def _first_of(self, tries: dict[asyncio.Task, float], timeout_s: float) -> list[asyncio.Task]:
        """The tries done within ``timeout_s`` (at once when one is done already); none when the
        time ran out or leadership was lost meanwhile."""
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            done, _ = await asyncio.wait({*tries, lost}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        return [task for task in done if task is not lost]

    async def _first_answer(self):
        """``_refresh_and_read`` on every client at once: the first that answers (the last failure
        when none does)."""
        if len(self.refreshers) == 1:
            return await self._refresh_and_read(self.refreshers[0])
        pending = {asyncio.ensure_future(self._refresh_and_read(c)) for c in self.refreshers}
        try:
            while True:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                answered = [t for t in done if t.exception() is None]
                if answered or not pending:
                    return (answered or list(done))[0].result()
        finally:
            for task in pending:
                task.cancel()

    async def _refresh_and_read(self, client: aetcd.Client):
        """The lease refreshed and the key read on ``client``, both sent now; the first failure ends both."""
        refresh = asyncio.ensure_future(client.refresh_lease(self.lease_id))
        read = asyncio.ensure_future(client.get(self.key))
        try:
            return await asyncio.gather(refresh, read)
        finally:
            for call in (refresh, read):
                call.cancel()

    def _lose(self, why: str) -> str:
        if self._lost.is_set():
            return self._why
        self._lost.set()
        self._why = why
        self.lease_id = None
        log.warning("block_service at %s is no longer the leader: %s; accepting no writes", self.me.address, why)
        return why

    async def resign(self) -> None:
        """Give the key up now (a clean stop): a standby takes over without waiting for the TTL."""
        if not self._lost.is_set():
            self._why = "resigned"
            self._lost.set()
        lease, self.lease_id = self.lease_id, None
        if lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.client.revoke_lease(lease), 2.0)
