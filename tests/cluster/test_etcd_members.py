"""etcd as three members (kvfleet.cli.etcd_server.EtcdCluster) and the fleet's clients over all
three (kvfleet.core.etcd_failover): the member the clients talk to is killed, and the block_service
leader keeps its lease, a node stays registered under its lease, the router's watch sees no node
leave, and writes go on, through the other two. Real etcd processes on loopback."""

from __future__ import annotations

import asyncio
import dataclasses
import signal

import aetcd
import pytest

from kvfleet.block_service.election import Election
from kvfleet.cli.etcd_auth import enable
from kvfleet.cli.etcd_server import EtcdCluster, EtcdServer
from kvfleet.core import certs
from kvfleet.core.identity import ADMIN_ID, ETCD_ID, ROUTER_ID, Identity
from kvfleet.core.leader import Leader
from kvfleet.core.membership import NodeInfo, NodeRegistration, NodeState, etcd_client, list_nodes, watch_nodes
from kvfleet.core.tls import Credentials

pytestmark = pytest.mark.process  # starts etcd processes (EtcdCluster)

PREFIX = "/kvfleet/test-members/nodes/"
LEADER = "/kvfleet/test-members/leader"
TTL_S = 4
# etcd electing a new raft leader takes one election timeout (1 s) and more, and the block_service
# leader fences itself TTL/2 after its last refresh, which is at most TTL/3 old: a TTL of 10 leaves
# it 1.7 s or more; the default 5 (0.8 s) does not (what the test below would show with it).
TTL_RAFT_LEADER_KILLED_S = 10


@pytest.fixture
def members(tmp_path):
    cluster = EtcdCluster(3, data_dir=tmp_path / "etcd").start()
    try:
        yield cluster
    finally:
        cluster.stop()


async def _raft_leader(url: str, credentials: Credentials | None = None) -> str:
    """The client URL of the member that leads etcd's raft now."""
    async with etcd_client(url, timeout=5.0, credentials=credentials) as client:
        status = await client.status()
    return status.leader.client_urls[0]


async def _through(url: str, killed: EtcdServer, ttl_s: int, writes_may_fail: bool) -> None:
    """Kill ``killed`` (every client's first member) and watch for two TTLs; only while etcd
    elects a new raft leader (``writes_may_fail``) may a write fail (etcd takes none then)."""
    info = NodeInfo("n1", "127.0.0.1:7001", "/models/tiny", 64, 16, NodeState.READY)
    async with etcd_client(url, timeout=1.0) as elector, etcd_client(url, timeout=1.0) as node, \
            etcd_client(url, timeout=1.0) as router:
        election = Election(elector, Leader("127.0.0.1:7000", "lineage-a"), ttl_s=ttl_s, key=LEADER)
        assert await election.campaign()
        leading = asyncio.create_task(election.lead())
        registration = NodeRegistration(node, info, ttl=ttl_s, prefix=PREFIX)
        await registration.start()
        lease = registration.lease_id
        changes = watch_nodes(router, PREFIX, retry_s=0.2)
        assert (await asyncio.wait_for(anext(changes), 10.0)).info == info
        seen = []
        watching = asyncio.create_task(_collect(changes, seen))
        for client in (elector, node, router):
            assert client.member.port == killed.client_port  # all of them on the member killed next

        killed.process.send_signal(signal.SIGKILL)
        killed.process.wait()
        failed_writes = 0
        for step in range(int(2 * ttl_s / 0.1)):  # two TTLs: a lease not refreshed would lapse
            assert election.holds(), f"the leader lost its lease {step / 10:.1f} s after the kill"
            try:
                await elector.put(f"{LEADER}-writes/{step}".encode(), b"x")  # writes go on
            except aetcd.ClientError:
                failed_writes += 1
                if not writes_may_fail:
                    raise
            await asyncio.sleep(0.1)
        await elector.put(f"{LEADER}-writes/last".encode(), b"x")
        assert failed_writes < ttl_s / 0.1, f"{failed_writes} writes failed"
        assert not leading.done()
        for client in (elector, node, router):
            assert client.member.port != killed.client_port
        assert registration.lease_id == lease  # never registered again: the lease held
        nodes, _ = await list_nodes(node, PREFIX)
        assert nodes == {"n1": info}
        assert all(change.info is not None for change in seen), seen  # the router saw no node leave
        watching.cancel()
        await registration.close()
        await election.resign()
        await asyncio.gather(leading, watching, return_exceptions=True)
        await changes.aclose()


async def _collect(changes, seen: list) -> None:
    async for change in changes:
        seen.append(change)


def test_the_member_the_clients_talk_to_is_killed_and_nothing_lapses(members):
    async def main():
        raft_leader = await _raft_leader(members.url)
        # a follower first: the leader keeps leading raft, so no etcd election adds to the gap
        order = sorted(members.members, key=lambda m: m.url == raft_leader)
        await _through(",".join(m.url for m in order), order[0], TTL_S, writes_may_fail=False)

    asyncio.run(main())


def test_the_raft_leader_is_killed_and_the_lease_holds_through_etcd_electing_another(members):
    async def main():
        raft_leader = await _raft_leader(members.url)
        order = sorted(members.members, key=lambda m: m.url != raft_leader)
        await _through(",".join(m.url for m in order), order[0], TTL_RAFT_LEADER_KILLED_S, writes_may_fail=True)

    asyncio.run(main())


def test_three_members_under_mutual_tls_with_the_fleets_roles(tmp_path):
    """What ``kvfleet up --etcd-members 3`` starts: auth set up through the list, its first member
    down; a node then registers and the router reads it, each as itself, through the others."""
    node_0 = Identity.node("node-0")
    certs.ensure(tmp_path / "certs", [ADMIN_ID, ETCD_ID, ROUTER_ID, node_0])

    def as_(identity):
        return Credentials.load(certs.identity_dir(tmp_path / "certs", identity), identity)

    with EtcdCluster(3, data_dir=tmp_path / "etcd", certs_dir=tmp_path / "certs") as cluster:
        assert cluster.url.count("https://") == 3
        raft_leader = asyncio.run(_raft_leader(cluster.url, as_(ADMIN_ID)))
        first = next(m for m in cluster.members if m.url != raft_leader)  # down: a quorum stays, with its leader
        url = ",".join(m.url for m in sorted(cluster.members, key=lambda m: m is not first))
        first.process.kill()
        first.process.wait()
        assert enable(url, as_(ADMIN_ID), ["node-0"]).enabled_now

        async def main():
            info = NodeInfo("node-0", "127.0.0.1:7001", "/models/tiny", 64, 16, NodeState.READY)
            async with etcd_client(url, credentials=as_(node_0)) as node, \
                    etcd_client(url, credentials=as_(ROUTER_ID)) as router:
                registration = NodeRegistration(node, info, ttl=3)
                await registration.start()
                assert registration.lease_id is not None
                assert (await list_nodes(router))[0] == {"node-0": info}
                await registration.close()

        asyncio.run(main())


def test_a_member_that_hangs_is_left_behind_too(members):
    """A member stopped (SIGSTOP): connections stay open and nothing answers, as when it is cut off.
    The node's keep-alive times out there once and goes on through the next member; the router's
    watch on it breaks (keepalive pings) and lists again there, so it sees a node that joins later.
    (The block_service leader's refresh has TTL/6 left for a retry after a hung one, so its lease
    moves to the standby here: kept out of this test, said in issue 34.)"""
    async def main():
        raft_leader = await _raft_leader(members.url)
        order = sorted(members.members, key=lambda m: m.url == raft_leader)
        url, hung = ",".join(m.url for m in order), order[0]
        info = NodeInfo("n1", "127.0.0.1:7001", "/models/tiny", 64, 16, NodeState.READY)
        async with etcd_client(url, timeout=1.0) as node, etcd_client(url, timeout=1.0) as router:
            registration = NodeRegistration(node, info, ttl=TTL_S, prefix=PREFIX)
            await registration.start()
            lease = registration.lease_id
            changes = watch_nodes(router, PREFIX, retry_s=0.2)
            assert (await asyncio.wait_for(anext(changes), 10.0)).info == info
            seen = []
            watching = asyncio.create_task(_collect(changes, seen))  # as the router reads it: all the time
            hung.process.send_signal(signal.SIGSTOP)
            try:
                for _ in range(300):  # the keep-alive's ticks time out, the watch's pings go unanswered
                    if hung.client_port not in (node.member.port, router.member.port):
                        break
                    await asyncio.sleep(0.1)
                assert node.member.port != hung.client_port and router.member.port != hung.client_port
                assert registration.lease_id == lease  # the lease held
                late = dataclasses.replace(info, node_id="n2")
                joined = NodeRegistration(node, late, ttl=TTL_S, prefix=PREFIX)
                await joined.start()
                for _ in range(100):
                    if any(change.info == late for change in seen):
                        break
                    await asyncio.sleep(0.1)
                assert [c for c in seen if c.info is None] == [] and any(c.info == late for c in seen), seen
                await joined.close()
            finally:
                hung.process.send_signal(signal.SIGCONT)
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
            await registration.close()
            await changes.aclose()

    asyncio.run(main())
