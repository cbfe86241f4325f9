"""Recovery: the page table a state directory holds, rebuilt without writing anything.

Recovery loads the newest snapshot that verifies, replays the logs that follow it in order, and stops
at the first torn or corrupt record: the state is then exactly the state after the last good record.
When records are missing instead (a corrupt newest snapshot whose records no log holds, a log that
does not follow on), it refuses to start, saying which file and which records (``RecoveryError``):
never from a stale state.

A state written under one eviction policy is refused by a block_service configured with another
(``recover(..., eviction=...)``): the log's records name calls, not their results, so replaying them
under another policy would evict other blocks than the table that wrote them, and every later
record would land on the wrong ones. The policy's name is in every snapshot (``PageTable.to_dict``),
and every log follows a snapshot (``DurablePageTable.open`` writes one before its first record).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Collection
from dataclasses import dataclass, field

from kvfleet.block_service import wal_records as rec
from kvfleet.block_service.eviction import DEFAULT_POLICY
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.snapshot import SnapshotError, read_snapshot
from kvfleet.block_service.wal import scan_log

_LSN = re.compile(r"-(\d{20})\.(snap|log)$")


def numbered(state_dir: str, pattern: str, only: Collection[str] | None = None) -> list[tuple[int, str]]:
    """``(lsn, path)`` of the files matching ``pattern`` (and named in ``only``), oldest first."""
    found = []
    for path in glob.glob(os.path.join(state_dir, pattern)):
        m = _LSN.search(path)
        if m and (only is None or os.path.basename(path) in only):
            found.append((int(m.group(1)), path))
    return sorted(found)


class RecoveryError(Exception):
    """The state directory cannot be brought to its last good record: the message (one line) names
    the corrupt or missing file and the records that are gone. block_service refuses to start."""


@dataclass(slots=True)
class RecoveryReport:
    snapshot_path: str | None = None
    snapshot_lsn: int = 0
    records_applied: int = 0
    lsn: int = 0                    # records in the recovered state since the first start
    stop_path: str | None = None    # where replay stopped early, if it did
    stop_offset: int | None = None
    stop_reason: str | None = None
    corrupt_snapshots: list[str] = field(default_factory=list)  # newer than the one used, not used
    skipped: list[str] = field(default_factory=list)  # files not used, with why

    def summary(self) -> str:
        text = (f"recovered {self.lsn} records: snapshot {self.snapshot_path or '(none)'} at {self.snapshot_lsn}, "
                f"{self.records_applied} log records applied")
        if self.stop_reason:
            text += f"; stopped at {self.stop_path} offset {self.stop_offset}: {self.stop_reason}"
        return text + "".join(f"; skipped {s}" for s in self.skipped)


def recover(state_dir: str, only: Collection[str] | None = None,
            eviction: str | None = None) -> tuple[PageTable, RecoveryReport]:
    """Rebuild the page table from ``state_dir`` without writing anything (from the files named in
    ``only`` when given: a backup's manifest), under the eviction policy its snapshot names; with
    ``eviction``, refuse (``RecoveryError``) a snapshot that names another one.

    The newest snapshot that verifies is the base; the logs from its record on are replayed. A
    corrupt newer snapshot is skipped only if the logs reach past it (they are kept from the older
    snapshot on for that reason). Raises ``RecoveryError`` when records are missing: a log that
    starts later than the state before it ends, or a corrupt snapshot whose records no log holds.
    """
    report = RecoveryReport()
    table = PageTable(eviction or DEFAULT_POLICY)  # (no snapshot: the logs were written under it)
    corrupt: list[tuple[int, str, str]] = []  # (lsn, path, why), newest first
    for lsn, path in reversed(numbered(state_dir, "snapshot-*.snap", only)):
        try:
            report.snapshot_lsn, state = read_snapshot(path)
            table = PageTable.from_dict(state)
            report.snapshot_path = path
            if eviction is not None and table.eviction != eviction:
                raise RecoveryError(
                    f"{path} was written under the eviction policy {table.eviction!r}, and this block_service "
                    f"is configured with {eviction!r}: replaying its log under another policy would evict "
                    f"other blocks; configure {table.eviction!r}, or move the state directory aside to start empty")
            break
        except SnapshotError as err:
            corrupt.append((lsn, path, str(err).removeprefix(f"{path}: ")))
            report.corrupt_snapshots.append(path)
            report.skipped.append(str(err))
    expected = report.snapshot_lsn
    for start, path in numbered(state_dir, "wal-*.log", only):
        if start < report.snapshot_lsn:
            continue
        if report.stop_reason:
            report.skipped.append(f"{path}: after the stop")
            continue
        scan, records = scan_log(path)
        first = scan.start_lsn if scan.start_lsn != -1 else start
        if first != expected:
            raise RecoveryError(_missing(report, corrupt, expected, first,
                                         f"{path} starts at record {first}, the state from "
                                         f"{os.path.basename(report.snapshot_path or 'no snapshot')} "
                                         f"and the logs before it ends at record {expected}"))
        for offset, payload in records:
            try:
                rec.apply(table, payload)
            except Exception as err:  # CRC-valid but inapplicable: a bug or a foreign file
                scan.error = f"record at offset {offset} does not apply: {err}"
                scan.end_offset = offset
                break
            expected += 1
            report.records_applied += 1
        if scan.error:
            report.stop_path, report.stop_offset, report.stop_reason = path, scan.end_offset, scan.error
    report.lsn = expected
    table.mark_recovered()
    if corrupt and corrupt[0][0] > expected:
        where = f"{report.stop_path}: {report.stop_reason}" if report.stop_reason else "no later log"
        raise RecoveryError(_missing(report, corrupt, expected, corrupt[0][0], f"the logs end there ({where})"))
    return table, report


def _missing(report: RecoveryReport, corrupt: list[tuple[int, str, str]], first: int, end: int, why: str) -> str:
    """One line for a person: which file is bad, which records are gone, and what to do."""
    text = f"records {first}..{end - 1} are missing: {why}"
    if corrupt:
        lsn, path, reason = corrupt[0]
        text = (f"the newest snapshot {path} is corrupt ({reason}) and records {first}..{max(end, lsn) - 1} "
                f"are missing to rebuild it from {report.snapshot_path or 'an empty state'}: {why}")
    return text + "; restore the state directory from a backup, or move it aside to start empty"
