"""The leader's side of ``FollowLog``: stream the log to one standby, take its acknowledgements.

    standby: FollowLogRequest(from_lsn, prev_crc, lineage) ─▶ leader
    leader:  LogEntry(lsn) hello ─▶ [snapshot parts, when the records are not here] ─▶ records ... as they are durable
    standby: FollowLogRequest(acked_lsn) ... (what is durable on it; --sync-standby waits for it)

gRPC glue over ``ReplicationLog`` (which records it still has), ``StandbyAcks`` (who acknowledged
what) and ``Role`` (the stream ends, UNAVAILABLE, as soon as this replica stops leading, after the
records it holds that the standby has not been sent: the standby's ``Replica._drain`` applies them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import grpc

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.lineage import lineage_mismatch
from kvfleet.block_service.replication_log import ReplicationLog, split_framed
from kvfleet.block_service.role import Role
from kvfleet.block_service.snapshot import encode_snapshot
from kvfleet.block_service.standby_acks import StandbyAcks
from kvfleet.core.errors import Unavailable
from kvfleet.v1 import block_manager_pb2 as pb

log = logging.getLogger(__name__)

SNAPSHOT_PART_BYTES = 1 << 20
IDLE_CHECK_S = 0.5  # how often an idle stream checks that this replica still leads


class ReplicationSource:
    def __init__(self, store: DurablePageTable, rlog: ReplicationLog, acks: StandbyAcks, role: Role,
                 lineage: Callable[[], str]) -> None:
        self.store = store
        self.rlog = rlog
        self.acks = acks
        self.role = role
        self.lineage = lineage

    async def follow(self, requests, context: grpc.aio.ServicerContext):
        first = await anext(aiter(requests), None)
        if first is None:
            return
        try:
            self.role.check_writable()
        except Unavailable as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        lineage = self.lineage()
        mismatch = lineage_mismatch(f"the standby {first.standby_id}'s state directory", first.lineage or None,
                                    lineage, "this replica")
        if mismatch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        standby = first.standby_id or context.peer()
        self.acks.connect(standby)
        acks = asyncio.create_task(self._read_acks(requests, standby))
        try:
            lsn = first.from_lsn
            yield pb.LogEntry(lineage=lineage, lsn=lsn)
            other_policy = first.eviction and first.eviction != self.store.table.eviction
            if other_policy:
                log.warning("standby %s replays under the eviction policy %r, this leader's is %r: sending it a "
                            "snapshot, whose policy it takes", standby, first.eviction, self.store.table.eviction)
            if other_policy or not self.rlog.continues(lsn, first.prev_crc if first.has_prev else None):
                async for entry in self._snapshot(lineage, standby, lsn):
                    yield entry
                    lsn = entry.lsn
            while not acks.done():
                if not self.role.holds():
                    # fenced: no record is added any more; the ones the standby lacks go first (some
                    # may have been acknowledged while it was out of sync), then the stream ends
                    with contextlib.suppress(Exception):  # a failed log: what is durable still goes
                        await self.store.flush()
                    data = self.rlog.read(lsn)
                    if data:
                        yield pb.LogEntry(lineage=lineage, lsn=lsn, records=data)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this replica stopped leading")
                data = self.rlog.read(lsn)
                if data is None:  # it fell behind what is kept in memory
                    async for entry in self._snapshot(lineage, standby, lsn):
                        yield entry
                        lsn = entry.lsn
                elif data:
                    yield pb.LogEntry(lineage=lineage, lsn=lsn, records=data)
                    lsn += len(split_framed(data))
                else:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self.rlog.wait_past(lsn), IDLE_CHECK_S)
        finally:
            acks.cancel()
            self.acks.disconnect(standby)

    async def _read_acks(self, requests, standby: str) -> None:
        with contextlib.suppress(Exception):  # the stream ended or broke: the follow loop ends too
            async for request in requests:
                self.acks.ack(standby, request.acked_lsn)

    async def _snapshot(self, lineage: str, standby: str, behind: int):
        """The whole state at the current record, in parts (the last one ``snapshot_done``)."""
        await self.store.flush()
        lsn, state = self.store.lsn, self.store.table.to_dict()  # no await between: one position
        data = await asyncio.get_running_loop().run_in_executor(None, encode_snapshot, lsn, state)
        log.info("standby %s at record %d: sending a snapshot at record %d (%.1f MiB)", standby, behind, lsn,
                 len(data) / (1 << 20))
        for start in range(0, len(data), SNAPSHOT_PART_BYTES):
            end = start + SNAPSHOT_PART_BYTES
            yield pb.LogEntry(lineage=lineage, lsn=lsn, snapshot_part=data[start:end], snapshot_done=end >= len(data))
