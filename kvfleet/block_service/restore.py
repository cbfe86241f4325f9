"""Restore a state directory from a backup (``backup``): the state at the backup's last shipped
record, written atomically as one snapshot.

    kvfleet checkpoint restore --from BACKUP --state-dir DIR [--force] [--partial]

Every file the manifest lists is checked against its size and CRC32 first. A corrupt snapshot is
refused (nothing to start from). A corrupt log segment is refused, naming it and the last record
that verifies; ``--partial`` restores up to that record instead — the rule block_service applies to
its own log at start (``durable.recover``: stop at the first bad record, say where). The restored
directory is built beside ``DIR``, fsynced, and renamed into place: a crash leaves ``DIR`` as it was.
A non-empty ``DIR`` is refused unless ``--force``, which moves it aside (``DIR.replaced-<time>``)
rather than deleting it.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from kvfleet.block_service.backup import MANIFEST, BackupError, Manifest, check_file, read_manifest
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import RecoveryError, recover
from kvfleet.block_service.snapshot import write_snapshot
from kvfleet.block_service.wal import fsync_dir


@dataclass(slots=True)
class RestoreReport:
    state_dir: str
    lsn: int                        # records in the restored state
    shipped_lsn: int                # records the backup holds when whole
    bad_file: str | None = None     # the corrupt segment restored up to (--partial)
    why: str | None = None
    replaced: str | None = None     # where the old state directory went (--force)

    def summary(self) -> str:
        text = f"restored {self.state_dir} to record {self.lsn} of {self.shipped_lsn} shipped"
        if self.bad_file:
            text += f"; stopped at {self.bad_file}: {self.why}"
        if self.replaced:
            text += f"; the previous state directory is now {self.replaced}"
        return text


def load_backup(backup_dir: str, partial: bool = False) -> tuple[PageTable, Manifest, RestoreReport]:
    """The page table a backup restores to, without writing anything."""
    manifest = read_manifest(backup_dir)
    if manifest is None:
        raise BackupError(f"{backup_dir}: no {MANIFEST}: not a backup directory")
    report = RestoreReport("", 0, manifest.shipped_lsn)
    listed = []
    for f in manifest.files:
        error = check_file(backup_dir, f)
        if error is not None:
            if f.kind == "snapshot" or not partial:
                hint = "" if f.kind == "snapshot" else "; --partial restores up to its last good record"
                raise BackupError(f"corrupt backup: {error}{hint}")
            report.bad_file, report.why = os.path.join(backup_dir, f.name), error
        listed.append(f.name)
        if report.bad_file:
            break  # its good records are used; the segments after it do not follow on
    try:
        table, rec = recover(backup_dir, only=listed)  # in place: a stray file is not read
    except RecoveryError as err:
        raise BackupError(f"{backup_dir}: {err}") from None
    report.lsn = rec.lsn
    if rec.stop_reason and not report.bad_file:  # the shipped bytes, yet a record does not apply
        if not partial:
            raise BackupError(f"corrupt backup: {rec.stop_path} offset {rec.stop_offset}: {rec.stop_reason} "
                              f"(last good record {rec.lsn - 1}); --partial restores up to it")
        report.bad_file, report.why = rec.stop_path, rec.stop_reason
    return table, manifest, report



def restore(backup_dir: str, state_dir: str, force: bool = False, partial: bool = False,
            fsync: bool = True) -> RestoreReport:
    """Write ``state_dir`` from ``backup_dir`` (see the module doc); ``BackupError`` says why not."""
    state_dir = os.path.normpath(state_dir)
    if os.path.isdir(state_dir) and os.listdir(state_dir) and not force:
        raise BackupError(f"{state_dir} is not empty; restore into an empty directory, or --force to move "
                          f"it aside")
    table, manifest, report = load_backup(backup_dir, partial)
    report.state_dir = state_dir
    staging = f"{state_dir}.restoring"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    write_snapshot(staging, report.lsn, table.to_dict(), fsync)
    parent = os.path.dirname(os.path.abspath(state_dir))
    if os.path.exists(state_dir):
        if os.listdir(state_dir):
            report.replaced = f"{state_dir}.replaced-{time.strftime('%Y%m%dT%H%M%S')}"
            os.replace(state_dir, report.replaced)
        else:
            os.rmdir(state_dir)
    os.replace(staging, state_dir)
    if fsync:
        fsync_dir(parent)
    return report
