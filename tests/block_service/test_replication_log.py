"""Replication's pure parts: frames checked by CRC before anything is applied, the leader's record
window, the standby's replay giving the leader's state, semi-sync acknowledgements, the role check."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.lineage import ensure_lineage, lineage_mismatch, read_lineage
from kvfleet.block_service.replication_log import ReplicationLog
from kvfleet.block_service.role import Role
from kvfleet.block_service.standby_acks import StandbyAcks
from kvfleet.block_service.trace import Trace, drive
from kvfleet.block_service.wal import FrameError, frame, read_frames
from kvfleet.core.errors import Unavailable


def _leader(tmp_path, steps: int = 20) -> tuple[DurablePageTable, ReplicationLog]:
    store, _ = DurablePageTable.open(str(tmp_path / "leader"), fsync=False)
    rlog = ReplicationLog(store.lsn)
    store.on_durable = rlog.append
    store.register_node("n0", 300, 16, 1 << 16)
    trace = Trace(seed=3, node_ids=["n0"], tenants=["a", "b"])
    for _ in range(steps):
        drive(store, trace.step())
        store.sync()
    return store, rlog


def test_frames_decode_and_a_flipped_bit_rejects_the_whole_message() -> None:
    data = frame(b"\x01first") + frame(b"\x02second")
    assert read_frames(data) == [b"\x01first", b"\x02second"]
    corrupt = bytearray(data)
    corrupt[-3] ^= 0x10  # inside the second record's payload
    with pytest.raises(FrameError, match="record 1: CRC mismatch"):
        read_frames(bytes(corrupt))
    with pytest.raises(FrameError, match="record 1"):
        read_frames(data[:-2])  # cut short


def test_a_standby_replaying_the_stream_holds_the_leaders_state(tmp_path) -> None:
    leader, rlog = _leader(tmp_path)
    standby, _ = DurablePageTable.open(str(tmp_path / "standby"), fsync=False)
    assert rlog.continues(0, None)
    while (data := rlog.read(standby.lsn, max_bytes=512)):
        for payload in read_frames(data):
            standby.append_replicated(payload)
        standby.sync()
    assert standby.lsn == leader.lsn > 20
    assert standby.table.to_dict() == leader.table.to_dict()
    # a restarted replica still continues a standby from its logs, checked by the last record's CRC
    standby.close()
    again, _ = DurablePageTable.open(str(tmp_path / "standby"), fsync=False)
    seeded = ReplicationLog.from_state_dir(str(tmp_path / "standby"), again.lsn)
    assert seeded.end_lsn == leader.lsn and seeded.prev_crc(leader.lsn) == rlog.prev_crc(leader.lsn)
    assert rlog.continues(again.lsn, seeded.prev_crc(again.lsn))


def test_a_state_that_went_another_way_or_fell_behind_needs_a_snapshot(tmp_path) -> None:
    _, rlog = _leader(tmp_path)
    end = rlog.end_lsn
    assert rlog.continues(end, rlog.prev_crc(end))
    assert not rlog.continues(end, rlog.prev_crc(end) ^ 1)   # same position, another last record
    assert not rlog.continues(end, None)                      # cannot say which record it ends with
    assert not rlog.continues(end + 1, rlog.prev_crc(end))    # ahead of the leader
    small = ReplicationLog(0, max_bytes=200)
    small.append(rlog.end_lsn, rlog.read(0, max_bytes=1 << 30))
    assert small.first_lsn > 0 and small.read(0) is None       # no longer in memory
    assert small.read(small.end_lsn) == b""                    # nothing new yet


def test_sync_acks_wait_for_the_standby_and_degrade_when_it_is_late() -> None:
    async def run() -> None:
        head = [10]
        acks = StandbyAcks(sync=True, timeout_s=0.2, head=lambda: head[0])
        await acks.wait(10)                       # nobody connected: async, at once
        acks.connect("s")
        acks.ack("s", 10)
        assert acks.in_sync == {"s"}
        head[0] = 11
        waiting = asyncio.create_task(acks.wait(11))
        await asyncio.sleep(0)
        assert not waiting.done()                 # held until the standby has record 10
        acks.ack("s", 11)
        await waiting
        head[0] = 12
        await acks.wait(12)                       # never acknowledged: it falls out of sync
        assert acks.in_sync == set()
        await acks.wait(12)                       # and answers no longer wait for it
        head[0] = 20                              # under load the leader's head moves on ...
        acks.ack("s", 12)
        assert acks.in_sync == {"s"}              # ... it is in sync again once it reached where it fell out
        acks.disconnect("s")
        assert acks.in_sync == set()

    asyncio.run(run())


def test_only_the_leader_may_write_and_a_refusal_names_it() -> None:
    Role().check_writable()
    role = Role(holds=lambda: False)
    with pytest.raises(Unavailable, match="no leader is elected yet"):
        role.check_writable()
    role.leader_address = "10.0.0.7:50051"
    with pytest.raises(Unavailable, match="10.0.0.7:50051"):
        role.check_writable()


def test_lineage_is_recorded_once_and_another_is_refused_in_one_line(tmp_path) -> None:
    state = str(tmp_path / "s")
    assert read_lineage(state) is None
    mine = ensure_lineage(state)
    assert ensure_lineage(state) == mine == read_lineage(state)
    assert lineage_mismatch(state, mine, mine, "x:1") is None
    assert lineage_mismatch(state, None, "other", "x:1") is None
    line = lineage_mismatch(state, mine, "other", "x:1")
    assert "\n" not in line and mine in line and "other" in line
