"""The leader election against a real etcd: one winner per key, and a leader that cannot refresh its
lease stops holding it before the lease can expire (the self-fence), with nothing faked."""

from __future__ import annotations

import asyncio
import signal

import pytest

from kvfleet.block_service.election import Election
from kvfleet.cli.etcd_server import EtcdServer
from kvfleet.core.leader import Leader, read_leader
from kvfleet.core.membership import etcd_client


@pytest.fixture
def etcd(tmp_path):
    server = EtcdServer(data_dir=tmp_path / "etcd").start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.process.send_signal(signal.SIGCONT)
        server.stop()


def test_one_replica_wins_and_the_other_takes_over_once_it_resigns(etcd) -> None:
    async def run() -> None:
        async with etcd_client(etcd.url) as client:
            a = Election(client, Leader("a:1", "L"), ttl_s=2)
            b = Election(client, Leader("b:1", "L"), ttl_s=2)
            assert await a.campaign() and a.holds()
            assert not await b.campaign() and not b.holds()
            assert (await read_leader(client))[0] == Leader("a:1", "L")
            leading = asyncio.create_task(a.lead())
            await a.resign()
            assert await leading == "resigned" and not a.holds()
            assert await b.campaign() and b.holds()
            await b.resign()

    asyncio.run(run())


def test_a_leader_cut_off_from_etcd_fences_itself_at_half_its_ttl(etcd) -> None:
    """The clock is the election's own (injected): holds() turns False TTL/2 after the last refresh
    was sent, whatever etcd does, so the fence comes before etcd can expire the lease (>= TTL); the
    leadership ends once the lease can have lapsed (TTL after that send) with no refresh answered."""
    now = [1000.0]

    async def run() -> str:
        async with etcd_client(etcd.url, timeout=0.5) as client:
            election = Election(client, Leader("a:1", "L"), ttl_s=4, clock=lambda: now[0])
            assert await election.campaign()
            etcd.process.send_signal(signal.SIGSTOP)  # etcd stops answering: no refresh succeeds
            try:
                now[0] += 1.9
                assert election.holds()
                now[0] += 0.1                         # TTL/2 after the campaign was sent
                assert not election.holds()
                now[0] += 2.0                         # TTL after it: the lease can have lapsed
                return await asyncio.wait_for(election.lead(), 30)
            finally:
                etcd.process.send_signal(signal.SIGCONT)

    assert "lapsed" in asyncio.run(run())


def test_a_pause_of_etcd_shorter_than_the_margin_costs_tries_not_leadership(etcd) -> None:
    """etcd frozen for 3 s (as while a three-member etcd elects its raft leader, or a member hangs
    and the client moves on): with TTL 10 the leader refreshes every TTL/6 and fences TTL/2 after
    its last success, so a failed refresh must be tried again in the TTL/3 left, not given up on.
    Refreshing every TTL/3 with one try, the leader lost its lease to any pause of more than TTL/6."""
    async def run() -> bool:
        async with etcd_client(etcd.url, timeout=0.5) as client:
            election = Election(client, Leader("a:1", "L"), ttl_s=10)
            assert await election.campaign()
            leading = asyncio.create_task(election.lead())
            await asyncio.sleep(2.0)              # past the first refresh
            etcd.process.send_signal(signal.SIGSTOP)
            try:
                await asyncio.sleep(3.0)
            finally:
                etcd.process.send_signal(signal.SIGCONT)
            await asyncio.sleep(3.0)              # past the fence of a refresh sent before the pause
            still = election.holds() and not leading.done()
            await election.resign()
            await asyncio.wait_for(leading, 10)
            return still

    assert asyncio.run(run())
