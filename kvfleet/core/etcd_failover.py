"""aetcd over several etcd members: the fleet's one etcd client class (``kvfleet.core.membership.etcd_client``).

aetcd talks to one address. ``FailoverClient`` keeps aetcd's calls and gives them a member at a
time (``kvfleet.core.etcd_endpoints``): a call that finds its member unavailable (killed, restarting,
cut off from a quorum: gRPC ``UNAVAILABLE``) moves the client to the next member and is made
again there, each member at most once per call; a call that times out moves the client too but
fails as before (its caller retries, as for etcd down), so a call never waits more than one
timeout; so does a call its caller gave up on (cancelled: the caller's own deadline passed first).
With one member nothing moves: errors reach the caller as they always did.

A member can also fail silently: cut off from the client (a watch then waits forever) or from its
peers (it answers, but with nothing new). With several members, the channel pings its member while
a call or watch is open (gRPC keepalive, above etcd's ``--grpc-keepalive-min-time`` of 5 s), so a
watch on a member that vanished breaks; and every request asks for a member that has a raft leader
(etcd's ``hasleader`` metadata, as etcd's own client's ``WithRequireLeader``), so a member cut off
from the others refuses at once (unavailable: the client moves) and ends its watches.

Moving opens a channel to the next member; the old one's watches end (their consumers list again
through the new channel: ``kvfleet.core.etcd_watch``) and the old channel is closed once the calls
still on it have had their timeout, not at once, since closing a gRPC channel cancels its calls.
A subclass chooses the channel (``kvfleet.core.etcd_tls``: mutual TLS).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import aetcd
import grpc
from aetcd import rpc, watcher

from kvfleet.core.backoff import error_line
from kvfleet.core.etcd_endpoints import Endpoint, EndpointRotation, EtcdEndpoints
from kvfleet.core.etcd_watcher import Watcher

log = logging.getLogger(__name__)

# with several members: ping the member every 6 s while a call is open (etcd refuses pings more often
# than every 5 s), however long nothing else was sent (gRPC stops after 2 by default), and give up on
# it when a ping has no answer in 3 s (gRPC 1.5x times a ping out by ping_timeout_ms, not keepalive's)
KEEPALIVE = {"grpc.keepalive_time_ms": 6000, "grpc.keepalive_timeout_ms": 3000, "grpc.http2.ping_timeout_ms": 3000,
             "grpc.keepalive_permit_without_calls": 0, "grpc.http2.max_pings_without_data": 0,
             "grpc.use_local_subchannel_pool": 1}  # each client its own connection, its own pings
REQUIRE_LEADER = (("hasleader", "true"),)
RETIRE_GRACE_S = 10.0  # an old channel's calls get this long (more than their timeout) before it closes

# aetcd's calls that talk to etcd, each wrapped once (the others are built on these: watch_prefix
# on watch, replace on transaction; ``members``, a generator, is left as aetcd has it)
CALLS = ("get", "get_prefix", "get_range", "get_all", "put", "delete", "delete_prefix", "delete_range",
         "watch", "watch_once", "transaction", "lease", "revoke_lease", "refresh_lease", "get_lease_info",
         "status", "compact")


def _failing_over(call):
    @functools.wraps(call)
    async def on_some_member(self: FailoverClient, *args, **kwargs):
        for attempt in range(1, self.num_members + 1):
            at = self.rotation.current
            try:
                return await call(self, *args, **kwargs)
            except aetcd.ConnectionFailedError as e:
                self._move_past(at, e)
                if attempt == self.num_members or self.rotation.current == at:
                    raise
            except aetcd.ConnectionTimeoutError as e:
                self._move_past(at, e)
                raise
            except asyncio.CancelledError as e:
                self._move_past(at, e)
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")
    return on_some_member


class FailoverClient(aetcd.Client):
    """An ``aetcd.Client`` over ``endpoints``' members, one at a time, in plaintext; unconnected
    until first used (or ``async with``), as aetcd's own."""

    def __init__(self, endpoints: EtcdEndpoints, timeout: float | None = None, options: dict | None = None) -> None:
        first = endpoints.members[0]
        if len(endpoints.members) > 1:
            options = {**KEEPALIVE, **(options or {})}
        super().__init__(host=first.host, port=first.port, timeout=timeout, options=options)
        self.endpoints = endpoints
        self.rotation = EndpointRotation(len(endpoints.members))
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}

    @property
    def num_members(self) -> int:
        return self.rotation.num_members

    @property
    def member(self) -> Endpoint:
        """The member this client talks to now."""
        return self.endpoints.members[self.rotation.current]

    def _open_channel(self, target: str) -> grpc.aio.Channel:
        return grpc.aio.insecure_channel(target, options=list(self._options.items()))

    async def connect(self) -> None:
        """aetcd's ``connect`` to the current member. Nothing here awaits, so no other task can see
        it half done (aetcd's version waits for a password login, which kvfleet does not use)."""
        if self._connected.is_set():
            return
        self.channel = self._open_channel(self.member.target)
        self.metadata = REQUIRE_LEADER if self.num_members > 1 else None
        self.auth_stub = rpc.AuthStub(self.channel)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        # kvfleet's Watcher: aetcd's binds a timed-out creation's late answer to the next watch
        self._watcher = Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()

    def _move_past(self, failed: int, error: Exception) -> None:
        """Member ``failed`` did not answer: the next call goes to the next member (once, however
        many calls saw it fail). Nothing here awaits."""
        if not self.rotation.move_past(failed):
            return
        why = "the call was given up" if isinstance(error, asyncio.CancelledError) else error_line(error)
        log.warning("etcd member %s did not answer (%s); moving to %s", self.endpoints.members[failed].target,
                    why, self.member.target)
        channel, old_watcher = self.channel, self._watcher
        self._init_channel_attrs()
        self._connected.clear()
        if channel is not None:
            task = asyncio.get_running_loop().create_task(self._retire(channel, old_watcher))
            self._retiring[task] = channel
            task.add_done_callback(lambda t: self._retiring.pop(t, None))

    @staticmethod
    async def _retire(channel: grpc.aio.Channel, old_watcher: watcher.Watcher | None) -> None:
        if old_watcher is not None:
            with contextlib.suppress(Exception):
                await old_watcher.shutdown()  # its watches end; their consumers list again
        await asyncio.sleep(RETIRE_GRACE_S)
        await channel.close()

    async def close(self) -> None:
        for task, channel in list(self._retiring.items()):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            await channel.close()
        self._retiring.clear()
        await super().close()


for _name in CALLS:
    assert asyncio.iscoroutinefunction(getattr(aetcd.Client, _name)), _name
    setattr(FailoverClient, _name, _failing_over(getattr(aetcd.Client, _name)))
