"""Two block_service replicas as real processes with a real etcd (shortened lease): the standby
holds the leader's state, takes over when the leader is SIGKILLed with every acknowledged change,
refuses a leader of another lineage, and a deposed leader answers writes UNAVAILABLE. All of it under
mutual TLS (``replicas``): the standby follows the leader's log as ``block-service``, the test writes
as the node it names and reads as ``admin``."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from replicas import TTL_S, ReplicaProcess, credentials, issue_certs, leader_address, wait_leader

from kvfleet.block_service import leader_client
from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.durable_mark import parse_mark, read_mark
from kvfleet.block_service.lineage import write_lineage
from kvfleet.block_service.trace import Trace, drive_async
from kvfleet.cli.etcd_server import EtcdServer
from kvfleet.core import tls
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.errors import Unavailable
from kvfleet.core.identity import ADMIN_ID, Identity
from kvfleet.core.leader import LEADER_KEY
from kvfleet.core.membership import etcd_client
from kvfleet.core.tls import Credentials


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory) -> Path:
    return issue_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def admin(certs_dir: Path) -> Credentials:
    return credentials(certs_dir, ADMIN_ID)


@pytest.fixture
def as_n0(certs_dir: Path) -> Iterator[None]:
    """This process calls as ``node:n0``: ``leader_client`` follows the leader with this process's
    credentials, as a node does."""
    before = tls.current()
    tls.use(credentials(certs_dir, Identity.node("n0")))
    try:
        yield
    finally:
        tls.use(before)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(data_dir=tmp_path / "etcd").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def replicas(tmp_path: Path, etcd: EtcdServer, certs_dir: Path):
    """``start(name, *flags)`` → a started replica; every one killed after the test."""
    started: list[ReplicaProcess] = []

    def start(name: str, *extra: str) -> ReplicaProcess:
        replica = ReplicaProcess(name, tmp_path, etcd.url, certs_dir, *extra).start()
        started.append(replica)
        return replica

    try:
        yield start
    finally:
        for replica in started:
            replica.kill()


async def _state(address: str, admin: Credentials) -> tuple:
    """Everything a reader can see of a replica's page table (its pools, live sequences and
    charges), and its log position."""
    async with BlockManagerClient(address, timeout_s=10, credentials=admin) as client:
        await client.wait_ready(30)
        report = await client.blocks(top_holders=1000)
    nodes = sorted((n.stats.node_id, n.stats.num_free, n.stats.num_cached, n.stats.num_used, n.stats.tokens_stored,
                    sorted((h.seq_id, h.num_blocks, h.num_tokens) for h in n.holders)) for n in report.nodes)
    tenants = sorted((t.tenant, t.node_id, t.blocks_charged, t.num_sequences) for t in report.tenants)
    return report.log_records, nodes, tenants


async def _wait_same_state(leader: str, standby: str, admin: Credentials, timeout_s: float = 60.0) -> tuple:
    deadline = time.monotonic() + timeout_s
    while True:
        mine, theirs = await _state(leader, admin), await _state(standby, admin)
        if mine == theirs or time.monotonic() > deadline:
            return mine, theirs
        await asyncio.sleep(0.2)


async def _wait_mark(etcd_url: str, leader: str, admin: Credentials, timeout_s: float = 30.0) -> None:
    """Until the leader's durable mark in etcd covers every record ``leader`` holds (it writes the
    mark every third of the lease TTL)."""
    records = (await _state(leader, admin))[0]
    deadline = time.monotonic() + timeout_s
    while True:
        async with etcd_client(etcd_url) as client:
            mark = parse_mark(await read_mark(client))
        if mark is not None and mark[1] >= records:
            return
        assert time.monotonic() < deadline, f"the mark {mark} does not cover {leader}'s {records} records"
        await asyncio.sleep(0.1)


async def _drive(address: str, certs_dir: Path, steps: int, seed: int = 5) -> None:
    """``steps`` of a trace on each of two nodes, each node's calls made as that node."""
    nodes = ("n0", "n1")
    clients = [BlockManagerClient(address, timeout_s=10, credentials=credentials(certs_dir, Identity.node(node)))
               for node in nodes]
    traces = [Trace(seed=seed + i, node_ids=[node], tenants=["a", "b"], arrivals_per_step=4, name=f"{node}-")
              for i, node in enumerate(nodes)]
    try:
        for node, client in zip(nodes, clients):
            await client.register_node(node, 300, 16, 1 << 16)
        for _ in range(steps):
            for client, trace in zip(clients, traces):
                await drive_async(client, trace.step())
    finally:
        for client in clients:
            await client.close()


def _leader_and_standby_after_a_trace(etcd, replicas, certs_dir, admin, *leader_flags: str):
    """A leader (``leader_flags``) and a standby, 40 steps of a trace on the leader; both replicas,
    and both states once equal (or the timeout)."""
    a = replicas("a", "--sync-standby", *leader_flags)
    wait_leader(etcd.url, a.address, [a])
    b = replicas("b", "--standby")

    async def run() -> tuple:
        await _drive(a.address, certs_dir, 40)
        return await _wait_same_state(a.address, b.address, admin)

    return a, b, *asyncio.run(run())


def test_standby_holds_the_leaders_state_after_many_changes(etcd, replicas, certs_dir, admin) -> None:
    _, _, mine, theirs = _leader_and_standby_after_a_trace(etcd, replicas, certs_dir, admin)
    assert mine[0] > 40 and mine[1], "the trace made changes"
    assert theirs == mine


@pytest.mark.chaos
def test_standby_takes_over_with_every_acknowledged_change(etcd, replicas, admin, as_n0) -> None:
    a = replicas("a", "--sync-standby")
    wait_leader(etcd.url, a.address, [a])
    b = replicas("b", "--standby", "--sync-standby")

    async def before_kill(client) -> dict[str, list[int]]:
        await client.register_node("n0", 400, 16, 1 << 16)
        await _wait_same_state(a.address, b.address, admin)  # the standby is in sync from here on
        acknowledged = {}
        for i in range(30):
            [result] = await client.allocate_many([AllocateRequest("n0", f"s{i}", "t", [], 40)])
            assert isinstance(result, Allocation)
            acknowledged[f"s{i}"] = result.block_ids
        return acknowledged

    async def run() -> None:
        async with await leader_client.connect("etcd", etcd.url, timeout_s=5) as client:
            acknowledged = await before_kill(client)
            a.kill()  # SIGKILL: no resignation, the lease lapses
            deadline = time.monotonic() + 60
            while True:  # the next write goes through once the standby leads
                try:
                    [result] = await client.allocate_many([AllocateRequest("n0", "after", "t", [], 40)])
                    break
                except Exception:
                    assert time.monotonic() < deadline, b.log_text()[-3000:]
                    await asyncio.sleep(0.1)
            assert isinstance(result, Allocation)
            assert client.target == b.address
            async with BlockManagerClient(b.address, timeout_s=10, credentials=admin) as reader:
                held = {s.seq_id: s.block_ids for s in await reader.sequences(list(acknowledged))}
            assert held == acknowledged

    asyncio.run(run())
    assert leader_address(etcd.url) == b.address


def test_a_standby_of_another_lineage_refuses_in_one_line(etcd, replicas, tmp_path: Path) -> None:
    a = replicas("a")
    wait_leader(etcd.url, a.address, [a])
    write_lineage(str(tmp_path / "b-state"), "0123456789abcdef")  # another cluster's state
    b = replicas("b", "--standby")
    try:
        assert b.proc.wait(timeout=60) == 2
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the standby did not refuse:\n{b.log_text()[-3000:]}") from None
    text = b.log_text()
    assert "Traceback" not in text
    [line] = [ln for ln in text.splitlines() if "lineage" in ln]
    assert "0123456789abcdef" in line and "move" in line


@pytest.mark.process
def test_standby_flags_without_etcd_are_refused_in_one_line(tmp_path: Path) -> None:
    import sys

    from replicas import ROOT

    out = subprocess.run([sys.executable, "-m", "kvfleet.cli.cli", "block-service", "--listen", "127.0.0.1:0",
                          "--state-dir", str(tmp_path / "s"), "--sync-standby", "--insecure-internal"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    assert "need --etcd" in out.stderr + out.stdout


@pytest.mark.chaos
def test_a_deposed_leader_refuses_writes_and_follows_the_new_one(etcd, replicas, certs_dir, admin) -> None:
    a = replicas("a")
    wait_leader(etcd.url, a.address, [a])
    b = replicas("b", "--standby")

    async def depose_a() -> None:
        await _wait_same_state(a.address, b.address, admin)  # b followed a once: it may campaign
        async with etcd_client(etcd.url) as client:  # an operator (or etcd) takes a's lease away
            kv = await client.get(LEADER_KEY.encode())
            await client.revoke_lease(kv.lease)

    asyncio.run(depose_a())
    wait_leader(etcd.url, b.address, [a, b])

    async def write_to_a() -> None:
        n9 = credentials(certs_dir, Identity.node("n9"))
        async with BlockManagerClient(a.address, timeout_s=10, credentials=n9) as client:
            deadline = time.monotonic() + 30
            while True:  # every try refused; until a has seen in etcd who leads instead
                with pytest.raises(Unavailable) as refused:
                    await client.register_node("n9", 8, 16, 1 << 16)
                if b.address in str(refused.value) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert b.address in str(refused.value)

    asyncio.run(write_to_a())
    mine, theirs = asyncio.run(_wait_same_state(b.address, a.address, admin))
    assert theirs == mine  # a follows b now
    assert "n9" not in [node[0] for node in mine[1]]


@pytest.mark.chaos
def test_a_replica_behind_the_last_leader_does_not_lead_after_a_double_failure(etcd, replicas, certs_dir, admin,
                                                                                as_n0) -> None:
    """a leads, dies; b takes over and acknowledges more; b dies; a restarts: a lacks b's records, so
    it must wait for b rather than lead (and serve a page table without them). b back: b leads."""
    a = replicas("a", "--sync-standby")
    wait_leader(etcd.url, a.address, [a])
    b = replicas("b", "--standby", "--sync-standby")

    async def write(n: int, prefix: str) -> None:
        async with await leader_client.connect("etcd", etcd.url, timeout_s=5) as client:
            if prefix == "first":
                await client.register_node("n0", 400, 16, 1 << 16)
                await _wait_same_state(a.address, b.address, admin)
            deadline = time.monotonic() + 60
            for i in range(n):
                while True:
                    try:
                        [result] = await client.allocate_many([AllocateRequest("n0", f"{prefix}{i}", "t", [], 16)])
                        break
                    except Exception:
                        assert time.monotonic() < deadline, "no leader took the write"
                        await asyncio.sleep(0.1)
                assert isinstance(result, Allocation)

    asyncio.run(write(5, "first"))
    a.kill()
    asyncio.run(write(10, "second"))  # acknowledged by b, now the leader
    assert leader_address(etcd.url) == b.address
    asyncio.run(_wait_mark(etcd.url, b.address, admin))  # etcd holds b's mark of all its records
    b.kill()
    a_again = replicas("a", "--sync-standby")
    # once b's lease lapses, a finds no leader and reads the mark: it says it will not lead, and
    # does not; a replica that ignored the mark would campaign at once instead
    deadline = time.monotonic() + 30 + TTL_S
    while "will not lead" not in a_again.log_text():
        assert leader_address(etcd.url) != a_again.address, "a replica without b's records took the lead"
        assert time.monotonic() < deadline, f"a neither led nor refused to:\n{a_again.log_text()[-3000:]}"
        time.sleep(0.1)
    assert leader_address(etcd.url) != a_again.address, "a replica without b's records took the lead"
    b_again = ReplicaProcess("b", b.state_dir.parent, etcd.url, certs_dir, "--standby", "--sync-standby")  # as up restarts it
    b_again.argv[b_again.argv.index("--listen") + 1] = b.address
    b_again.start()
    try:
        wait_leader(etcd.url, b.address, [b_again])
    finally:
        b_again.kill()


def test_a_standby_under_another_eviction_policy_takes_the_leaders_snapshot_and_policy(etcd, replicas, certs_dir,
                                                                                        admin) -> None:
    """The leader runs lru by choice; the standby is left to its default (auto: an empty state takes
    fair). Replaying lru's log under fair would evict other blocks, so the leader sends a snapshot,
    which names lru, and both tables stay equal through a trace that evicts."""
    a, b, mine, theirs = _leader_and_standby_after_a_trace(etcd, replicas, certs_dir, admin, "--eviction-policy", "lru")
    assert theirs == mine and mine[0] > 40
    assert "replays under the eviction policy 'fair', this leader's is 'lru'" in a.log_text()
    assert "took the leader's snapshot" in b.log_text()
