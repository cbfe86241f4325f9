"""Durability as a layer over the pure page table.

Every call that changes the page table becomes one log record (``wal_records``); the records of all
concurrent calls are group-committed — one write and one fsync — before any of them is answered.
A snapshot (on an interval, on clean shutdown, after recovery) lets older logs be deleted. The state
directory holds::

    snapshot-<lsn>.snap   the whole state after <lsn> records; the newest two are kept
    wal-<lsn>.log         records <lsn>, <lsn>+1, ...; kept from the older kept snapshot on
    wal-<lsn>.log.bad     a log that stopped recovery early, kept for inspection
    snapshot-<lsn>.snap.bad  a corrupt snapshot that recovery replaced, kept for inspection

``recovery`` rebuilds the page table from it when block_service starts.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence

from kvfleet.block_service import wal_records as rec
from kvfleet.block_service.bookkeeping import ApplyResult, TierBatch, apply_bookkeeping
from kvfleet.block_service.lineage import clear_reset, mark_reset
from kvfleet.block_service.lower_tiers import TierOutcome, validate_tier_change
from kvfleet.block_service.node_sync import LiveSequence, SyncResult
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.pins import PinResult
from kvfleet.block_service.recovery import RecoveryError, RecoveryReport, numbered, recover
from kvfleet.block_service.snapshot import write_snapshot
from kvfleet.block_service.wal import LogWriter, frame, log_name
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal, TierChange
from kvfleet.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from kvfleet.core.tenants import Tenant

log = logging.getLogger(__name__)

KEEP_SNAPSHOTS = 2
# what a caller opening a state directory meets: ``open`` raises RecoveryError, tools call recover
__all__ = ["DurablePageTable", "RecoveryError", "RecoveryReport", "recover"]


class DurablePageTable:
    """The page table's mutators, each recorded in the log; reads go to ``self.table`` directly.

    Without a ``state_dir`` nothing is logged (durability off, for measurements and tests).
    """

    def __init__(self, table: PageTable, state_dir: str | None, lsn: int = 0, fsync: bool = True) -> None:
        self.table = table
        self.state_dir = state_dir
        self.fsync = fsync
        self.lsn = lsn            # records appended
        self.durable_lsn = lsn    # records on disk
        self._buf = bytearray()
        self._writer: LogWriter | None = None
        self._flushing: asyncio.Future | None = None
        self._snapshot_lock = asyncio.Lock()
        self._failed: BaseException | None = None
        self.last_snapshot = time.monotonic()
        self.on_write: Callable[[float], None] | None = None  # seconds of each group commit (metrics)
        # (lsn after them, framed records) once they are on disk: what replication sends (loop thread)
        self.on_durable: Callable[[int, bytes], None] | None = None
        self.pins_refused: dict[tuple[str, str], int] = {}  # (tenant, reason) -> pins refused since start

    @classmethod
    def open(cls, state_dir: str, fsync: bool = True,
             eviction: str | None = None) -> tuple[DurablePageTable, RecoveryReport]:
        """Recover from ``state_dir`` (created if missing), then start a clean snapshot and log.
        Raises ``RecoveryError`` (having written nothing) when the state cannot be recovered, or
        was written under another eviction policy than ``eviction`` (None: the state's own; an
        empty state takes the default)."""
        os.makedirs(state_dir, exist_ok=True)
        table, report = recover(state_dir, eviction=eviction)
        store = cls(table, state_dir, report.lsn, fsync)
        for path in report.corrupt_snapshots:  # kept for inspection, never read again
            os.replace(path, path + ".bad")
        write_snapshot(state_dir, report.lsn, table.to_dict(), fsync)
        if report.stop_path:  # only now that the snapshot holds everything before the stop
            for lsn, path in numbered(state_dir, "wal-*.log"):
                if lsn >= report.snapshot_lsn and path >= report.stop_path:
                    os.replace(path, path + ".bad")
        store._writer = LogWriter(os.path.join(state_dir, log_name(report.lsn)), report.lsn, fsync)
        store._cleanup()
        return store, report

    # ---- mutators: call the core, log what changed ---------------------------------------------

    def register_node(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int) -> bool:
        self._check_writable()
        created = self.table.register_node(node_id, num_blocks, block_size, bytes_per_block)
        if created:
            self._log(rec.encode_register(node_id, num_blocks, block_size, bytes_per_block))
        return created

    def deregister_node(self, node_id: str) -> list[str]:
        self._check_writable()
        released = self.table.deregister_node(node_id)
        self._log(rec.encode_deregister(node_id))
        return released

    def sync_node(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int,
                  listed: Sequence[LiveSequence], tiers: Sequence[TierChange] | None = None) -> SyncResult:
        """``PageTable.sync_node``, then with ``tiers`` (the node's whole lower-tier index)
        ``replace_tiers``; each logged only when it changed something (a periodic reconciliation
        that finds agreement writes nothing). Invalid ``tiers`` raise before anything changes."""
        self._check_writable()
        for c in tiers or ():
            validate_tier_change(c, replacing=True)
        result = self.table.sync_node(node_id, num_blocks, block_size, bytes_per_block, listed)
        if result.changed:
            self._log(rec.encode_sync(node_id, num_blocks, block_size, bytes_per_block, result.listed))
        if tiers is not None and self.table.replace_tiers(node_id, tiers):
            self._log(rec.encode_tiers(node_id, tiers, replace=True))
        return result

    def record_tiers(self, node_id: str, changes: Sequence[TierChange]) -> TierOutcome:
        self._check_writable()
        out = self.table.record_tiers(node_id, changes)
        if out.applied:
            self._log(rec.encode_tiers(node_id, out.applied))
        return out

    def configure_tenants(self, configs: Iterable[Tenant], replace_all: bool = False) -> None:
        self._check_writable()
        configs = list(configs)
        self.table.configure_tenants(configs, replace_all)
        self._log(rec.encode_tenants(configs, replace_all))

    def allocate_many(self, requests: Sequence[AllocateRequest]) -> list[Allocation | Refusal]:
        self._check_writable()
        results = self.table.allocate_many(requests)
        done = [r for r, res in zip(requests, results) if type(res) is Allocation]
        if done:
            self._log(rec.encode_allocate(done))
        return results

    def extend(self, growth: Sequence[tuple[str, int]], tenant: str | None = None) -> list[list[int] | Refusal]:
        self._check_writable()
        results = self.table.extend(growth, tenant)
        done = [g for g, res in zip(growth, results) if type(res) is list]
        if done:
            self._log(rec.encode_extend(done))
        return results

    def commit(self, commits: Sequence[tuple[str, int, bytes]], tenant: str | None = None) -> int:
        self._check_writable()
        num_new = self.table.commit(commits, tenant)
        if num_new:
            self._log(rec.encode_commit(commits))
        return num_new

    def release(self, seq_ids: Sequence[str], tenant: str | None = None) -> None:
        self._check_writable()
        self.table.release(seq_ids, tenant)
        if seq_ids:
            self._log(rec.encode_release(seq_ids))

    def apply(self, growth: Sequence[tuple[str, int]], commits: Sequence[tuple[str, int, bytes]],
              releases: Sequence[str], tenant: str | None = None,
              drops: Sequence[tuple[str, int]] = (), tiers: TierBatch | None = None) -> ApplyResult:
        """A node's bookkeeping item by item (``bookkeeping``); the log gets what was applied."""
        self._check_writable()
        result, applied = apply_bookkeeping(self.table, growth, commits, releases, tenant, drops, tiers)
        if applied.growth:
            self._log(rec.encode_extend(applied.growth))
        if applied.commits:
            self._log(rec.encode_commit(applied.commits))
        if applied.drops:
            self._log(rec.encode_extend(applied.drops, rec.DROP))
        if applied.releases:
            self._log(rec.encode_release(applied.releases))
        if applied.tiers:
            self._log(rec.encode_tiers(tiers.node_id, applied.tiers))
        return result

    def pin_prefix(self, node_id: str, tenant: str, block_hashes: Sequence[bytes], expires_at: int) -> PinResult:
        """``FleetPins.pin``; a refusal is counted per tenant and reason (``pins_refused``)."""
        self._check_writable()
        try:
            result = self.table.pins.pin(node_id, tenant, block_hashes, expires_at)
        except (ResourceExhausted, FailedPrecondition) as err:
            key = (tenant, "budget" if isinstance(err, ResourceExhausted) else "no_budget")
            self.pins_refused[key] = self.pins_refused.get(key, 0) + 1
            raise
        self._log(rec.encode_pin(node_id, tenant, block_hashes, expires_at))
        return result

    def expire_pins(self, now: float) -> int:
        """End every pin whose expiry is at or before ``now`` (the leader's clock), one record per
        node; returns how many ended."""
        ended = 0
        for node_id, hashes in self.table.pins.due(now):
            self._check_writable()
            ended += self.table.pins.expire(node_id, hashes)
            self._log(rec.encode_unpin(node_id, hashes))
        return ended

    def append_replicated(self, payload: bytes) -> None:
        """A standby: the leader's record ``self.lsn``, replayed and logged as it came (raises,
        having changed nothing, when it does not decode or apply)."""
        rec.apply(self.table, payload)
        self._log(payload)

    async def reset(self, lsn: int, state: dict) -> None:
        """A standby: become the leader's snapshot at ``lsn`` (this state was empty, too far
        behind, or went another way). Every snapshot and log here is removed first, so that a
        restart can only recover this state, never mix the two (a crash in between leaves an empty
        state, marked so that it follows a leader again before it may lead)."""
        table = PageTable.from_dict(state)  # raises before anything is touched when it does not load
        async with self._snapshot_lock:
            await self.flush()
            self._writer.close()
            mark_reset(self.state_dir)
            for _, path in numbered(self.state_dir, "snapshot-*.snap") + numbered(self.state_dir, "wal-*.log"):
                os.remove(path)
            write_snapshot(self.state_dir, lsn, state, self.fsync)
            self._writer = LogWriter(os.path.join(self.state_dir, log_name(lsn)), lsn, self.fsync)
            clear_reset(self.state_dir)
            table.mark_recovered()
            self.table, self.lsn, self.durable_lsn = table, lsn, lsn

    # ---- the log -------------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._failed is not None:
            raise Unavailable(f"the write-ahead log failed ({self._failed}); restart the service")

    def _log(self, payload: bytes) -> None:
        if self._writer is None:
            return
        self._buf += frame(payload)
        self.lsn += 1

    @property
    def log_bytes(self) -> int:
        return self._writer.size if self._writer else 0

    def _write(self, data: bytes, lsn: int) -> None:
        started = time.perf_counter()
        try:
            self._writer.write(data)
            if self.on_write is not None:
                self.on_write(time.perf_counter() - started)
        except OSError as err:
            self._failed = err
            log.critical("write-ahead log write failed: %s; refusing further changes", err)
            raise Unavailable(f"the write-ahead log failed: {err}") from err
        self.durable_lsn = lsn

    def sync(self) -> None:
        """Write and fsync every pending record (blocking)."""
        if self._buf:
            data, lsn = bytes(self._buf), self.lsn
            self._buf.clear()
            self._write(data, lsn)
            self._durable(lsn, data)

    def _durable(self, lsn: int, data: bytes) -> None:
        if self.on_durable is not None:
            self.on_durable(lsn, data)

    async def flush(self) -> None:
        """Return once every record appended so far is durable; concurrent callers share fsyncs."""
        target = self.lsn
        while self.durable_lsn < target:
            self._check_writable()
            if self._flushing is None:
                self._flushing = asyncio.ensure_future(self._flush_once())
            await asyncio.shield(self._flushing)

    async def _flush_once(self) -> None:
        try:
            data, lsn = bytes(self._buf), self.lsn
            self._buf.clear()
            await asyncio.get_running_loop().run_in_executor(None, self._write, data, lsn)
            self._durable(lsn, data)
        finally:
            self._flushing = None

    # ---- snapshots -----------------------------------------------------------------------------

    def snapshot(self) -> str | None:
        """Write a snapshot of the current state and start a new log (blocking)."""
        if self._writer is None:
            return None
        self.sync()
        lsn, state = self._rotate()
        return self._finish_snapshot(lsn, state)

    async def snapshot_async(self) -> str | None:
        """Like ``snapshot`` but the snapshot file is written off the event loop; changes made
        meanwhile go to the new log."""
        if self._writer is None:
            return None
        async with self._snapshot_lock:
            while self._buf or self._flushing is not None:
                await self.flush()
                if self._flushing is not None:
                    await asyncio.shield(self._flushing)
            lsn, state = self._rotate()
            return await asyncio.get_running_loop().run_in_executor(None, self._finish_snapshot, lsn, state)

    async def run_exclusive(self, fn, *args):
        """Run ``fn(durable_lsn, *args)`` in a worker thread while no snapshot rotates the log or
        deletes old files (log shipping reads the state directory): the event loop keeps serving.
        ``durable_lsn`` is the last record on disk when it starts."""
        async with self._snapshot_lock:
            return await asyncio.get_running_loop().run_in_executor(None, fn, self.durable_lsn, *args)

    def _rotate(self) -> tuple[int, dict]:
        """Cut the log at the current record: returns ``(lsn, state)`` to snapshot."""
        assert not self._buf and self._flushing is None, "rotate with records in flight"
        self._check_writable()
        lsn, state = self.lsn, self.table.to_dict()
        old, self._writer = self._writer, LogWriter(os.path.join(self.state_dir, log_name(lsn)), lsn, self.fsync)
        old.close()
        self.last_snapshot = time.monotonic()
        return lsn, state

    def _finish_snapshot(self, lsn: int, state: dict) -> str:
        path = write_snapshot(self.state_dir, lsn, state, self.fsync)
        self._cleanup()
        return path

    def _cleanup(self) -> None:
        """Keep the newest snapshots and the logs from the oldest of them on, so that a newest
        snapshot found corrupt at the next start is replaced by the older one and its logs."""
        snapshots = numbered(self.state_dir, "snapshot-*.snap")
        for _, path in snapshots[:-KEEP_SNAPSHOTS]:
            os.remove(path)
        oldest = snapshots[-KEEP_SNAPSHOTS:][0][0] if snapshots else 0
        for start, path in numbered(self.state_dir, "wal-*.log"):
            if start < oldest:
                os.remove(path)
        for path in glob.glob(os.path.join(self.state_dir, "*.tmp")):
            os.remove(path)

    def close(self) -> None:
        """Clean shutdown: snapshot, so that the next start replays nothing."""
        if self._writer is not None:
            if self._failed is None:
                self.snapshot()
            self._writer.close()
            self._writer = None
