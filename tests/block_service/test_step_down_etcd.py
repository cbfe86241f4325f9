"""A leader that every live node says it cannot reach resigns, against a real etcd: it leads while
one node still reaches it, then, once the last one complains, its key is gone (lease revoked), it
accepts no writes and it counts the step-down; nothing else is faked but the standby's state."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvfleet.block_service import step_down_watch
from kvfleet.block_service.replica import NODES_UNREACHABLE, Replica, ReplicaConfig
from kvfleet.block_service.role import Role
from kvfleet.cli.etcd_server import EtcdServer
from kvfleet.core.leader import read_leader, unreachable_key
from kvfleet.core.membership import etcd_client, node_key

ME = "127.0.0.1:7100"


@pytest.fixture
def etcd(tmp_path):
    with EtcdServer(data_dir=tmp_path / "etcd") as server:  # started, and stopped whatever the test did
        yield server


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_the_leader_steps_down_once_every_live_node_complains(etcd, tmp_path, monkeypatch):
    monkeypatch.setattr(step_down_watch, "COOL_DOWN_TTLS", 0)  # it took over just now: no cool-down here
    decisions: list[int] = []
    reasons: list[str] = []

    def standby_ready() -> bool:
        decisions.append(1)
        return True

    async def on_lead() -> None:
        return None

    async def run() -> None:
        async with etcd_client(etcd.url) as client:
            for node in ("n0", "n1"):
                await client.put(node_key(node), b"{}")
            await client.put(unreachable_key("n0"), ME.encode())
            await client.put(unreachable_key("n1"), b"10.0.0.9:7100")  # about a leader before: no count
            follower = SimpleNamespace(store=SimpleNamespace(durable_lsn=0, lsn=0), followed=True)
            role = Role()
            replica = Replica(client, role, follower, ReplicaConfig(ME, str(tmp_path / "state"), 2, False), on_lead,
                              standby_ready, reasons.append)
            leading = asyncio.create_task(replica._campaign())

            async def leads() -> bool:
                leader, _ = await read_leader(client)
                return leader is not None and leader.address == ME and role.holds()

            await _until(leads)
            seen = len(decisions)

            async def decided_again() -> bool:
                return len(decisions) >= seen + 4

            await _until(decided_again)  # decisions taken with n0's complaint alone in view
            assert not leading.done() and role.holds()
            await client.put(unreachable_key("n1"), ME.encode())
            assert await asyncio.wait_for(leading, 10) is True
            assert reasons == [NODES_UNREACHABLE] and not role.holds()
            assert (await read_leader(client))[0] is None  # the lease revoked: a standby may win at once

    asyncio.run(run())
