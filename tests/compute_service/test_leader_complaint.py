"""A node's complaint that it cannot reach block_service's leader: when it starts (failing for half
the leader's TTL), when it ends (an answer, another leader), and what the node writes in etcd (under
its own lease, once per change). Pure state machine, and the glue against fakes: no process."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvfleet.compute_service.blocks.complaint import LeaderComplaint
from kvfleet.compute_service.blocks.leader_reach import MIN_THRESHOLD_S, LeaderReach, threshold_for
from kvfleet.core.leader import Leader, unreachable_key


def test_the_threshold_is_half_the_leaders_ttl_and_at_least_one_second():
    assert threshold_for(6) == 3.0
    assert threshold_for(1) == MIN_THRESHOLD_S


def test_a_complaint_takes_two_failed_probes_since_the_last_answer_and_the_threshold():
    reach = LeaderReach()
    reach.follow("a:1", 1.5, now=10.0)         # named at 10: heard from, in effect
    assert reach.complaint(20.0) is None       # no probe went out: no evidence
    first, second = reach.sent("a:1"), reach.sent("a:1")
    reach.expired("a:1", first)
    assert reach.complaint(20.0) is None       # one failed probe is not enough
    reach.expired("a:1", second)
    assert reach.complaint(11.4) is None       # nor before the threshold
    assert reach.complaint(11.5) == "a:1"
    third = reach.sent("a:1")
    reach.answered("a:1", third, now=12.0)     # any later probe answered: it is reachable
    assert reach.complaint(20.0) is None
    late = reach.sent("a:1")
    reach.answered("a:1", late, now=12.5)
    reach.expired("a:1", third)                # an older probe failing after a later answer says nothing
    fourth, fifth = reach.sent("a:1"), reach.sent("a:1")
    reach.expired("a:1", fourth)
    assert reach.complaint(20.0) is None
    reach.expired("a:1", fifth)
    assert reach.complaint(20.0) == "a:1"
    reach.follow("a:1", 1.5, now=21.0)         # the same leader named again: nothing changes
    assert reach.complaint(21.0) == "a:1"


def test_another_leader_starts_over_and_an_answer_of_the_old_one_is_ignored():
    reach = LeaderReach()
    reach.follow("a:1", 1.0, now=0.0)
    old = [reach.sent("a:1") for _ in range(2)]
    for probe in old:
        reach.expired("a:1", probe)
    assert reach.complaint(5.0) == "a:1"
    reach.follow("b:1", 1.0, now=5.0)
    assert reach.complaint(5.0) is None
    for probe in [reach.sent("b:1") for _ in range(2)]:
        reach.expired("b:1", probe)
    about_a = reach.sent("a:1")                # a probe of the old leader: not about b
    reach.answered("a:1", about_a, now=5.5)    # ... nor is its answer
    assert reach.complaint(6.0) == "b:1"
    reach.follow("a:1", 1.0, now=6.5)          # back to a: its probes of the earlier term say nothing
    reach.expired("a:1", old[0])
    reach.expired("a:1", about_a)
    assert reach.complaint(9.0) is None
    reach.follow(None, 1.0, now=7.0)           # nobody leads: nobody to complain about
    assert reach.complaint(9.0) is None


class Unreachable(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode = grpc.StatusCode.DEADLINE_EXCEEDED) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class FakeBlocks:
    """The node's block_service client: its target and a ping that fails while ``down`` (as one
    that went its whole time unanswered, unless told otherwise)."""

    def __init__(self, target: str) -> None:
        self.target, self.down, self.error = target, False, Unreachable()
        self.waited_for_ready: list[bool] = []

    async def ping(self, timeout_s: float, wait_for_ready: bool = False) -> None:
        self.waited_for_ready.append(wait_for_ready)
        if self.down:
            raise self.error


class FakeEtcd:
    def __init__(self) -> None:
        self.ops: list[tuple] = []

    async def put(self, key: bytes, value: bytes, lease: int | None = None) -> None:
        self.ops.append(("put", key, value, lease))

    async def delete(self, key: bytes) -> None:
        self.ops.append(("delete", key))


def _complaint(blocks: FakeBlocks, etcd: FakeEtcd, lease: list[int | None], now: list[float]) -> LeaderComplaint:
    complaint = LeaderComplaint("node-0", etcd, blocks, lambda: lease[0], clock=lambda: now[0])
    complaint.leader = Leader("a:1", "L", ttl_s=4)  # what its watch of etcd would set
    return complaint


async def _ticks(complaint: LeaderComplaint, now: list[float], times) -> None:
    """A tick at each time, its probe answered (or not) before the next."""
    for t in times:
        now[0] = t
        await complaint.tick()
        await asyncio.sleep(0)  # the probe's task runs: the fakes answer at once


def test_the_node_says_so_in_etcd_under_its_lease_once_and_withdraws_it():
    key = unreachable_key("node-0")
    blocks, etcd, lease, now = FakeBlocks("a:1"), FakeEtcd(), [7], [100.0]
    complaint = _complaint(blocks, etcd, lease, now)

    async def run() -> None:
        assert await complaint.tick() == pytest.approx(2.0 / 3)  # threshold TTL/2 = 2 s, 3 probes in it
        assert etcd.ops == [("delete", key)]   # a previous run's complaint, if any, goes first
        await asyncio.sleep(0)                 # answered at 100.0
        blocks.down = True
        await _ticks(complaint, now, [100.5, 101.0, 101.5])
        assert etcd.ops == [("delete", key)]   # 1.5 s without an answer: not yet
        await _ticks(complaint, now, [102.0, 102.5])
        assert etcd.ops[1:] == [("put", key, b"a:1", 7)]  # once, under the node's lease
        lease[0] = 8                           # etcd lost the node's lease; it registered again
        await _ticks(complaint, now, [103.0])
        assert etcd.ops[2:] == [("put", key, b"a:1", 8)]
        blocks.down = False
        await _ticks(complaint, now, [103.5, 104.0, 104.5])  # answered at 103.5: withdrawn at the next tick
        assert etcd.ops[3:] == [("delete", key)]
        await complaint.close()

    asyncio.run(run())


def test_no_complaint_about_an_answer_nor_without_a_lease_nor_about_another_target_or_an_old_leader():
    blocks, etcd, lease, now = FakeBlocks("a:1"), FakeEtcd(), [None], [0.0]
    complaint = _complaint(blocks, etcd, lease, now)

    async def run() -> None:
        blocks.down = True
        await _ticks(complaint, now, [0.0, 1.0, 2.0, 3.0, 4.0])
        assert [op[0] for op in etcd.ops] == ["delete"]  # silent, but not registered: nothing to tie it to
        blocks.error = Unreachable(grpc.StatusCode.PERMISSION_DENIED)  # an answer: it is reachable
        await _ticks(complaint, now, [5.0])
        lease[0] = 3
        await _ticks(complaint, now, [6.0, 7.0, 8.0, 9.0])
        assert [op[0] for op in etcd.ops] == ["delete"]
        blocks.error = Unreachable(grpc.StatusCode.DEADLINE_EXCEEDED)
        blocks.target = "b:1"  # the client already follows another leader: no probe says anything of a:1
        await _ticks(complaint, now, [10.0, 11.0, 12.0, 13.0])
        assert [op[0] for op in etcd.ops] == ["delete"]
        blocks.target = "a:1"
        await _ticks(complaint, now, [14.0, 15.0, 16.0, 17.0])
        assert etcd.ops[-1] == ("put", unreachable_key("node-0"), b"a:1", 3)
        complaint.leader = Leader("a:1", "L")  # a replica older than step-downs (no TTL said): moot
        await _ticks(complaint, now, [18.0])
        assert etcd.ops[-1] == ("delete", unreachable_key("node-0"))
        await complaint.close()

    asyncio.run(run())


def test_probes_cut_short_by_a_reconnect_are_no_complaint_however_long_it_takes():
    """Over a lossy link one connection reset (the soak's onset) cut every probe in flight short with
    UNAVAILABLE while the channel reconnected: counted as silence, the node complained after the
    threshold, and with every node doing so at once the leader stepped down. Only probes that waited
    their whole time (for the channel too) are evidence."""
    blocks, etcd, lease, now = FakeBlocks("a:1"), FakeEtcd(), [7], [100.0]
    complaint = _complaint(blocks, etcd, lease, now)

    async def run() -> None:
        await _ticks(complaint, now, [100.0])
        blocks.down, blocks.error = True, Unreachable(grpc.StatusCode.UNAVAILABLE)
        await _ticks(complaint, now, [100.5 + 0.5 * k for k in range(10)])  # 5 s of them
        assert [op[0] for op in etcd.ops] == ["delete"]
        assert all(blocks.waited_for_ready)  # a probe waits for the channel to connect
        blocks.error = Unreachable(grpc.StatusCode.DEADLINE_EXCEEDED)
        await _ticks(complaint, now, [105.5])
        assert [op[0] for op in etcd.ops] == ["delete"]  # one failed probe is not a cut
        await _ticks(complaint, now, [106.0])
        assert etcd.ops[-1] == ("put", unreachable_key("node-0"), b"a:1", 7)
        await complaint.close()

    asyncio.run(run())


def test_the_complaint_is_said_when_a_probe_fails_not_only_at_the_next_tick():
    class SlowToFail(FakeBlocks):
        async def ping(self, timeout_s: float, wait_for_ready: bool = False) -> None:
            if self.down:
                await asyncio.sleep(0.05)
                raise self.error

    blocks, etcd, lease, now = SlowToFail("a:1"), FakeEtcd(), [7], [100.0]
    complaint = _complaint(blocks, etcd, lease, now)

    async def run() -> None:
        await _ticks(complaint, now, [100.0])
        blocks.down = True
        now[0] = 101.0
        await complaint.tick()
        now[0] = 102.5
        await complaint.tick()
        assert [op[0] for op in etcd.ops] == ["delete"]
        await asyncio.sleep(0.2)  # both probes fail: 2.5 s since the last answer, over the 2 s threshold
        assert etcd.ops[-1] == ("put", unreachable_key("node-0"), b"a:1", 7)
        await complaint.close()

    asyncio.run(run())
