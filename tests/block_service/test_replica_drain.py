"""A standby whose leader's key lapsed while the leader's stream still delivers records applies them
before it may campaign (``Replica._drain``): a leader that fenced itself may have acknowledged them
while the standby lagged (out of sync). A stream that delivers nothing is abandoned; a new leader
named in etcd ends the following at once, as before."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvfleet.block_service import replica as replica_mod
from kvfleet.block_service.replica import Replica, ReplicaConfig
from kvfleet.block_service.role import Role
from kvfleet.core.leader import Leader

OLD = Leader("10.0.0.1:7100", "lineage")


class FakeFollower:
    """``Follower.follow``: applies ``records`` records, one each ``step_s``, then ends (or hangs)."""

    def __init__(self, records: int, step_s: float = 0.02, hang: bool = False) -> None:
        self.store = SimpleNamespace(lsn=0)
        self.records, self.step_s, self.hang = records, step_s, hang
        self.cancelled = False
        self.followed = True

    async def follow(self, leader: Leader) -> str:
        try:
            for _ in range(self.records):
                await asyncio.sleep(self.step_s)
                self.store.lsn += 1
            if self.hang:
                await asyncio.Event().wait()
            return "the stream broke: this replica stopped leading"
        except asyncio.CancelledError:
            self.cancelled = True
            raise


def _replica(follower: FakeFollower) -> Replica:
    async def on_lead() -> None:
        return None

    return Replica(None, Role(), follower, ReplicaConfig("10.0.0.2:7100", "/nonexistent", 3, True), on_lead)


async def _follow_then(replica: Replica, leader_next: Leader | None, after_s: float):
    """``_follow(OLD)`` while etcd names ``leader_next`` after ``after_s`` (the watch's change)."""
    replica.leader = OLD

    async def change() -> None:
        await asyncio.sleep(after_s)
        replica.leader = leader_next
        replica._changed.set()

    task = asyncio.create_task(change())
    why = await replica._follow(OLD)
    await task
    return why


def test_a_lapsed_leaders_stream_is_read_to_its_end_before_a_campaign():
    follower = FakeFollower(records=40)
    why = asyncio.run(_follow_then(_replica(follower), None, after_s=0.05))
    assert follower.store.lsn == 40 and not follower.cancelled
    assert why == "the stream broke: this replica stopped leading"


def test_a_lapsed_leaders_stream_that_delivers_nothing_is_abandoned(monkeypatch):
    monkeypatch.setattr(replica_mod, "DRAIN_IDLE_S", 0.1)
    follower = FakeFollower(records=3, hang=True)
    why = asyncio.run(_follow_then(_replica(follower), None, after_s=0.2))
    assert follower.store.lsn == 3 and follower.cancelled and why is None


def test_a_new_leader_named_ends_the_following_at_once():
    follower = FakeFollower(records=1000)
    why = asyncio.run(_follow_then(_replica(follower), Leader("10.0.0.3:7100", "lineage"), after_s=0.05))
    assert follower.cancelled and follower.store.lsn < 1000 and why is None
