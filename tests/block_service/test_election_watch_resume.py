"""The leader's watch of its own key survives its connection being killed: it is made again from the
revision after the last one it saw (in-process, a fake etcd). Over the lossy soak's link the kernel
killed block_service's main etcd connection (ETIMEDOUT) 2-4 times in 120 s; the key's watch ended for
good at the first kill, and a delete of the key (a lease revoked by hand) was seen only by the next
refresh's read of it, TTL/6 later, not at once."""

import asyncio
from types import SimpleNamespace

import aetcd

from kvfleet.block_service.election import Election
from kvfleet.core.leader import Leader

LEASE = 7


class _Watch:
    def __init__(self, events: asyncio.Queue) -> None:
        self.events = events

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.events.get()
        if isinstance(item, Exception):
            raise item
        return item

    async def cancel(self) -> None:
        return None


class _KilledWatchEtcd:
    """Refreshes answered at once and the key read as etcd holds it; the first watch of the key sees
    one rewrite of it by this lease (revision 3), then its connection is killed."""

    transactions = aetcd.client.Transactions()

    def __init__(self) -> None:
        self.starts: list[int] = []       # each watch's start revision
        self.holder: int | None = LEASE   # the key's lease; None: deleted
        self.watches: list[asyncio.Queue] = []

    async def lease(self, ttl):
        return SimpleNamespace(id=LEASE, ttl=ttl)

    async def transaction(self, compare, success, failure):
        return True, [SimpleNamespace(response_put=SimpleNamespace(header=SimpleNamespace(revision=1)))]

    async def refresh_lease(self, lease_id):
        return SimpleNamespace(TTL=60)

    async def get(self, key):
        return None if self.holder is None else SimpleNamespace(lease=self.holder)

    async def watch(self, key, start_revision=None):
        self.starts.append(start_revision)
        events: asyncio.Queue = asyncio.Queue()
        if len(self.starts) == 1:
            events.put_nowait(SimpleNamespace(kind=aetcd.EventKind.PUT, kv=SimpleNamespace(lease=LEASE, mod_revision=3)))
            events.put_nowait(ConnectionError("Stream removed (recvmsg:Connection timed out (110))"))
        self.watches.append(events)
        return _Watch(events)

    def delete_key(self) -> None:
        self.holder = None
        for events in self.watches:
            events.put_nowait(SimpleNamespace(kind=aetcd.EventKind.DELETE, kv=SimpleNamespace(lease=0, mod_revision=9)))

    async def revoke_lease(self, lease_id):
        return None


def test_a_killed_watch_of_the_key_is_made_again_from_the_last_revision_seen():
    async def run() -> tuple[bool, bool, list[int]]:
        etcd = _KilledWatchEtcd()
        election = Election(etcd, Leader("a:1", "L"), ttl_s=60)  # the next refresh's read 10 s away
        assert await election.campaign()
        leading = asyncio.create_task(election.lead())
        await asyncio.sleep(1.5)           # past the kill and the watch's retry
        held = election.holds()
        etcd.delete_key()                  # `etcdctl lease revoke` by an operator
        await asyncio.sleep(0.5)
        lost = not election.holds() and leading.done()
        await election.resign()
        await asyncio.wait_for(leading, 5)
        return held, lost, etcd.starts

    held, lost, starts = asyncio.run(run())
    assert held and lost
    assert starts[:2] == [2, 4]  # from the campaign's revision, then after the rewrite it saw
