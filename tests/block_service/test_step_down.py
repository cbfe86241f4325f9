"""The leader's decision to step down while it holds its lease: only when every live node says it
cannot reach this leader, a standby is caught up, and it did not just take over (pure); and the
replica acting on it (against a fake election)."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.replica import LEASE_LOST, NODES_UNREACHABLE, Replica, ReplicaConfig
from kvfleet.block_service.role import Role
from kvfleet.block_service.standby_acks import StandbyAcks
from kvfleet.block_service.step_down import COOLING, KEEP, NO_STANDBY, STEP_DOWN, Complaints, decide
from kvfleet.core.errors import Unavailable

ME, OTHER = "10.0.0.1:7100", "10.0.0.2:7100"


def _complaints(nodes: list[str], against: dict[str, str]) -> Complaints:
    complaints = Complaints()
    for node in nodes:
        complaints.node(node, live=True)
    for node, leader in against.items():
        complaints.complaint(node, leader)
    return complaints


@pytest.mark.parametrize("nodes, against, action", [
    (["n0", "n1"], {"n0": ME, "n1": ME}, STEP_DOWN),
    (["n0", "n1"], {"n0": ME}, KEEP),                 # n1 reaches it: n0's trouble is n0's
    (["n0", "n1"], {"n0": ME, "n1": OTHER}, KEEP),    # n1's complaint is about the leader before
    ([], {}, KEEP),                                   # no node, no evidence
    ([], {"n0": ME}, KEEP),                           # a complaint without a live node (its lease is going)
    (["n0"], {"n0": ME, "gone": ME}, STEP_DOWN),      # complaints of nodes not live do not count either way
])
def test_every_live_node_must_complain_about_this_leader(nodes, against, action):
    assert decide(_complaints(nodes, against), ME, standby_ready=True, led_s=60.0, cool_down_s=9.0).action == action


def test_it_keeps_leading_without_a_standby_to_take_over_or_within_the_cool_down():
    complaints = _complaints(["n0", "n1"], {"n0": ME, "n1": ME})
    no_standby = decide(complaints, ME, standby_ready=False, led_s=60.0, cool_down_s=9.0)
    assert no_standby.action == NO_STANDBY and "no standby" in no_standby.line
    cooling = decide(complaints, ME, standby_ready=True, led_s=8.9, cool_down_s=9.0)
    assert cooling.action == COOLING and "8.9 s ago" in cooling.line
    assert decide(complaints, ME, standby_ready=True, led_s=9.0, cool_down_s=9.0).action == STEP_DOWN


def test_a_node_that_leaves_or_withdraws_changes_the_verdict():
    complaints = _complaints(["n0", "n1"], {"n0": ME, "n1": ME})
    complaints.complaint("n1", None)
    assert decide(complaints, ME, True, 60.0, 9.0).action == KEEP
    complaints.node("n1", live=False)                # n1's lease went: n0 is the whole fleet
    assert decide(complaints, ME, True, 60.0, 9.0).action == STEP_DOWN


def test_a_standby_can_take_over_once_in_sync_or_caught_up():
    head = [10]
    sync = StandbyAcks(sync=True, timeout_s=2.0, head=lambda: head[0])
    assert not sync.can_take_over()                  # none connected
    sync.connect("b")
    sync.ack("b", 9)
    assert not sync.can_take_over()                  # connected, not in sync yet
    sync.ack("b", 10)
    assert sync.can_take_over()
    sync.disconnect("b")
    assert not sync.can_take_over()
    lazy = StandbyAcks(sync=False, timeout_s=2.0, head=lambda: head[0])
    lazy.connect("b")
    assert not lazy.can_take_over()
    lazy.ack("b", 10)                                # it reached where the leader was when it connected
    assert lazy.can_take_over()


class FakeElection:
    """``Election.lead`` / ``resign``: the lead ends when resigned or when the lease is lost."""

    def __init__(self) -> None:
        self.ended = asyncio.Event()
        self.why = ""

    async def lead(self) -> str:
        await self.ended.wait()
        return self.why

    async def resign(self) -> None:
        self.why = self.why or "resigned"
        self.ended.set()

    def lose(self) -> None:
        self.why = "the lease expired"
        self.ended.set()


def _replica() -> Replica:
    async def on_lead() -> None:
        return None

    return Replica(None, Role(), None, ReplicaConfig("10.0.0.1:7100", "/nonexistent", 3, False), on_lead)


def test_the_replica_resigns_when_the_watch_says_so_and_leads_on_when_the_watch_fails(caplog):
    async def due() -> str:
        return "none of the 2 live nodes can reach it"

    async def broken() -> str:
        raise RuntimeError("a bug")

    async def run() -> tuple[str, str, str]:
        election = FakeElection()
        stepped = await _replica()._lead(election, asyncio.create_task(due()))
        assert election.why == "resigned"
        election = FakeElection()
        asyncio.get_running_loop().call_later(0.05, election.lose)
        failed = await _replica()._lead(election, asyncio.create_task(broken()))
        election = FakeElection()
        asyncio.get_running_loop().call_later(0.05, election.lose)
        lost = await _replica()._lead(election, None)
        return stepped, failed, lost

    assert asyncio.run(run()) == (NODES_UNREACHABLE, LEASE_LOST, LEASE_LOST)
    assert "the step-down watch failed (a bug); leading on without it" in caplog.text


class HangingChannel:
    """A channel to a leader cut off: every call waits until the channel is closed, then ends as
    grpc.aio ends the calls of a channel it closes: ``CancelledError`` in the awaiter."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    def unary_unary(self, *args, **kwargs):
        async def call(request, timeout=None):
            await self.closed.wait()
            raise asyncio.CancelledError()
        return call

    unary_stream = stream_unary = stream_stream = unary_unary

    async def close(self) -> None:
        self.closed.set()


def test_a_call_under_way_to_a_leader_that_was_replaced_ends_unavailable_at_once():
    """Not at its deadline: the node's calls queue behind it, and a step-down would gain nothing."""
    async def run() -> None:
        client = BlockManagerClient("10.0.0.1:7100", channel=HangingChannel())
        call = asyncio.create_task(client.release(["seq-1"]))
        await asyncio.sleep(0)
        client.retarget("127.0.0.1:1")  # etcd names the new leader
        with pytest.raises(Unavailable, match="moved to 127.0.0.1:1 during the call"):
            await asyncio.wait_for(call, 5)
        await client.close()
        client = BlockManagerClient("10.0.0.1:7100", channel=HangingChannel())
        call = asyncio.create_task(client.release(["seq-2"]))
        await asyncio.sleep(0)
        call.cancel()                   # its caller gave up: that stays a cancellation
        client.retarget("127.0.0.1:1")
        with pytest.raises(asyncio.CancelledError):
            await call
        await client.close()

    asyncio.run(run())
