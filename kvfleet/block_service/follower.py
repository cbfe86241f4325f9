"""A standby's side of ``FollowLog``: apply the leader's records to this replica's durable state.

Each message's records are checked (length and CRC32 of every frame, ``wal.read_frames``) before
any is applied: a corrupt message is never applied, the stream is dropped and followed again from
this replica's last durable record. Records are applied and logged exactly as they came
(``DurablePageTable.append_replicated``: the same log positions as the leader), made durable with
one group commit per message, then acknowledged. A snapshot (the leader no longer has the records
this replica needs, or this replica is empty or went another way) replaces the whole state.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.lineage import lineage_mismatch, read_lineage, write_lineage
from kvfleet.block_service.replication_log import ReplicationLog
from kvfleet.block_service.snapshot import SnapshotError, decode_snapshot
from kvfleet.block_service.wal import FrameError, read_frames
from kvfleet.core import rpc
from kvfleet.core.backoff import error_line
from kvfleet.core.identity import BLOCK_SERVICE_ID
from kvfleet.core.leader import Leader
from kvfleet.v1 import block_manager_pb2 as pb

log = logging.getLogger(__name__)


class LineageMismatch(Exception):
    """This replica's state has another lineage than the leader's: it must not follow it."""


class Follower:
    def __init__(self, store: DurablePageTable, rlog: ReplicationLog, state_dir: str, standby_id: str) -> None:
        self.store = store
        self.rlog = rlog
        self.state_dir = state_dir
        self.standby_id = standby_id
        self.followed = False   # a leader's stream answered at least once (``--standby`` may then campaign)

    async def follow(self, leader: Leader) -> str:
        """Follow ``leader`` until its stream ends; returns why, in one line. Raises
        ``LineageMismatch`` when this state must not follow it."""
        mine = read_lineage(self.state_dir)
        mismatch = lineage_mismatch(self.state_dir, mine, leader.lineage, leader.address)
        if mismatch:
            raise LineageMismatch(mismatch)
        acks: asyncio.Queue[int | None] = asyncio.Queue()  # None: the stream is over, stop sending
        prev = self.rlog.prev_crc(self.store.lsn)

        async def requests():
            yield pb.FollowLogRequest(from_lsn=self.store.lsn, has_prev=prev is not None, prev_crc=prev or 0,
                                      lineage=mine or "", standby_id=self.standby_id,
                                      eviction=self.store.table.eviction)
            while (acked := await acks.get()) is not None:
                yield pb.FollowLogRequest(acked_lsn=acked)

        client = BlockManagerClient(leader.address, channel=rpc.channel(
            leader.address, rpc.MAX_MESSAGE_BYTES, peer=BLOCK_SERVICE_ID))
        call = client.follow_log(requests())
        try:
            return await self._apply(call, leader, mine, acks)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise LineageMismatch(err.details()) from None
            return f"the stream broke: {error_line(err)}"
        finally:
            # end the request iterator first: grpc's task that reads it would otherwise be left
            # waiting on the queue when the call breaks, and be destroyed pending (an ERROR line)
            acks.put_nowait(None)
            await asyncio.sleep(0)
            call.cancel()
            await client.close()

    async def _apply(self, call, leader: Leader, mine: str | None, acks: asyncio.Queue) -> str:
        snapshot = bytearray()
        async for entry in call:
            if mine is None:  # an empty or pre-replication state takes the leader's lineage
                write_lineage(self.state_dir, entry.lineage)
                mine = entry.lineage
            self.followed = True
            if entry.snapshot_part or entry.snapshot_done:
                snapshot += entry.snapshot_part
                if entry.snapshot_done:
                    try:
                        lsn, state = decode_snapshot(bytes(snapshot), f"the snapshot from {leader.address}")
                    except SnapshotError as err:
                        return f"{err}: dropped the stream, following again"
                    snapshot.clear()
                    await self.store.reset(lsn, state)
                    self.rlog.reset(lsn)
                    log.info("standby: took the leader's snapshot at record %d", lsn)
                    acks.put_nowait(lsn)
                continue
            if not entry.records:  # the leader's hello: where it continues from
                continue
            if entry.lsn != self.store.lsn:
                return f"records from {entry.lsn} arrived, this state ends at {self.store.lsn}: following again"
            try:
                payloads = read_frames(entry.records)
            except FrameError as err:
                log.error("standby: corrupt replication record from %s (%s); none of the message applied, "
                          "following again from record %d", leader.address, err, self.store.lsn)
                return f"corrupt record: {err}"
            for payload in payloads:
                try:
                    self.store.append_replicated(payload)
                except Exception as err:  # CRC-valid but inapplicable: a bug, or a foreign log
                    log.error("standby: the leader's record %d does not apply here: %s", self.store.lsn, err)
                    return f"record {self.store.lsn} does not apply"
            await self.store.flush()
            acks.put_nowait(self.store.durable_lsn)
        return "the leader ended the stream"


async def close_quietly(task: asyncio.Task | None, timeout_s: float = 5.0) -> None:
    """Cancel ``task`` and give it ``timeout_s`` to finish: a stop never hangs on a peer."""
    if task is not None:
        task.cancel()
        await asyncio.wait({task}, timeout=timeout_s)
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: nothing to report on a task being closed
