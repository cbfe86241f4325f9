"""A change acknowledged with no standby in sync waits for a durable mark in etcd that names it, so
that a standby lacking it cannot take over (the lossy partition soak lost 3 acknowledged writes and
granted 2 blocks twice without this). The etcd client is a fake: this is the waiting logic only."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvfleet.block_service import durable_mark
from kvfleet.block_service.durable_mark import DURABLE_KEY, MarkWriter
from kvfleet.block_service.standby_acks import StandbyAcks
from kvfleet.core.errors import Unavailable


class FakeEtcd:
    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.puts: list[dict] = []
        self.delay_s, self.fail = delay_s, fail

    async def put(self, key: bytes, value: bytes) -> None:
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("etcd unreachable")
        assert key == DURABLE_KEY.encode()
        self.puts.append(json.loads(value))


def test_covers_share_one_write_and_a_covered_change_waits_for_none():
    async def run():
        etcd, durable = FakeEtcd(delay_s=0.01), [7]
        writer = MarkWriter(etcd, "L", lambda: durable[0])
        await asyncio.gather(*(writer.cover(lsn) for lsn in (5, 6, 7)))
        assert etcd.puts == [{"lineage": "L", "lsn": 7}]  # one put named all three
        await writer.cover(7)
        assert len(etcd.puts) == 1
        durable[0] = 9
        await writer.cover(9)
        assert etcd.puts[-1] == {"lineage": "L", "lsn": 9}
    asyncio.run(run())


def test_a_mark_that_cannot_be_written_leaves_the_change_unacknowledged(monkeypatch):
    monkeypatch.setattr(durable_mark, "COVER_TIMEOUT_S", 0.05)

    async def run():
        for etcd in (FakeEtcd(fail=True), FakeEtcd(delay_s=1.0)):
            with pytest.raises(Unavailable, match="not acknowledged"):
                await MarkWriter(etcd, "L", lambda: 3).cover(3)
    asyncio.run(run())


def test_acks_wait_for_the_mark_only_with_no_standby_in_sync():
    async def run():
        head = [10]
        acks = StandbyAcks(sync=True, timeout_s=0.05, head=lambda: head[0])
        covered: list[int] = []

        async def cover(lsn: int) -> None:
            covered.append(lsn)
        acks.wait_alone_for(cover)
        await acks.wait(10)                       # no standby at all
        assert covered == [10]
        acks.connect("bs-b")
        acks.ack("bs-b", 10)                      # caught up: in sync
        head[0] = 12
        waiting = asyncio.create_task(acks.wait(12))
        await asyncio.sleep(0.01)
        acks.ack("bs-b", 12)
        await waiting
        assert covered == [10]                    # the standby holds it: no mark needed
        await acks.wait(13)                       # the standby does not ack in time: out of sync
        assert covered == [10, 13]
        acks.wait_alone_for(None)                 # the lead ended
        await acks.wait(14)
        assert covered == [10, 13]
    asyncio.run(run())


def test_without_sync_standby_nothing_waits():
    async def run():
        acks = StandbyAcks(sync=False, timeout_s=0.05, head=lambda: 0)

        async def cover(lsn: int) -> None:
            raise AssertionError("async replication does not wait")
        acks.wait_alone_for(cover)
        await acks.wait(5)
    asyncio.run(run())
