"""Verify a state directory, backup directory, snapshot or log: every snapshot's CRC, every log
record's CRC and form; restore a state directory from a backup.

    kvfleet checkpoint verify [--crc32] PATH
    kvfleet checkpoint restore --from BACKUP --state-dir DIR [--force] [--partial]
    python -m kvfleet.block_service.checkpoint --verify PATH

Prints one line per file (records counted, first bad offset), then for a directory what
block_service would recover from it — or why it would refuse to start, in the same words — and exits
0 only when every file verifies and the state recovers. A backup directory (``backup``: it has a
``MANIFEST.json``) also has each listed file's whole-file CRC32 and size checked against the manifest,
with or without ``--crc32`` (the field guide's command shape; snapshots and log records always carry
their own CRC32, which is always checked).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass, field

from kvfleet.block_service import wal_records
from kvfleet.block_service.backup import BackupError, check_file, read_manifest
from kvfleet.block_service.recovery import RecoveryError, recover
from kvfleet.block_service.restore import restore
from kvfleet.block_service.snapshot import MAGIC_PREFIX as SNAPSHOT_MAGIC
from kvfleet.block_service.snapshot import SnapshotError, read_snapshot
from kvfleet.block_service.wal import scan_log


@dataclass(slots=True)
class FileCheck:
    path: str
    kind: str                       # "snapshot" or "log"
    num_records: int = 0            # log records that verify (snapshots: 1 when valid)
    bad_offset: int | None = None   # first bad byte offset, None when the file verifies
    error: str | None = None

    def line(self) -> str:
        status = "ok" if self.error is None else f"BAD at offset {self.bad_offset}: {self.error}"
        return f"{self.kind:8} {self.path}: {self.num_records} records, {status}"


@dataclass(slots=True)
class VerifyReport:
    files: list[FileCheck] = field(default_factory=list)
    recovery: str | None = None         # a state directory: what recovery would give
    unrecoverable: str | None = None    # or why block_service would refuse to start

    @property
    def ok(self) -> bool:
        return bool(self.files) and all(f.error is None for f in self.files) and self.unrecoverable is None

    @property
    def first_bad(self) -> FileCheck | None:
        return next((f for f in self.files if f.error is not None), None)


def check_snapshot(path: str) -> FileCheck:
    check = FileCheck(path, "snapshot")
    try:
        read_snapshot(path)
        check.num_records = 1
    except SnapshotError as err:
        check.bad_offset, check.error = 0, str(err).removeprefix(f"{path}: ")
    return check


def check_log(path: str) -> FileCheck:
    check = FileCheck(path, "log")
    scan, records = scan_log(path)
    for offset, payload in records:
        try:
            wal_records.decode(payload)
        except Exception as err:  # CRC-valid but malformed
            check.bad_offset, check.error = offset, f"record does not decode: {err}"
            break
    check.num_records = scan.num_records
    if check.error is None and scan.error is not None:
        check.bad_offset, check.error = scan.end_offset, scan.error
    return check


def verify(path: str) -> VerifyReport:
    """Check ``path``: a state directory (its ``*.snap`` and ``*.log``) or one file of either kind."""
    report = VerifyReport()
    manifest = read_manifest(path) if os.path.isdir(path) else None
    if manifest is not None:
        return _verify_backup(path, manifest, report)
    if os.path.isdir(path):
        paths = sorted(glob.glob(os.path.join(path, "*.snap")) + glob.glob(os.path.join(path, "*.log")))
    else:
        paths = [path]
    report.files = [_check(p) for p in paths]
    if os.path.isdir(path) and report.files:
        _recovery(report, path)
    return report


def _check(path: str) -> FileCheck:
    with open(path, "rb") as f:
        is_snapshot = f.read(len(SNAPSHOT_MAGIC)) == SNAPSHOT_MAGIC or path.endswith(".snap")
    return check_snapshot(path) if is_snapshot else check_log(path)


def _recovery(report: VerifyReport, path: str, only: list[str] | None = None) -> None:
    try:
        report.recovery = recover(path, only)[1].summary()
    except RecoveryError as err:
        report.unrecoverable = str(err)


def _verify_backup(path: str, manifest, report: VerifyReport) -> VerifyReport:
    """The files the manifest lists, each against its size and CRC32, then its records; files it
    does not list (a ship that did not finish) are not part of the backup and are not read."""
    for f in manifest.files:
        whole = check_file(path, f)
        if whole is not None and not os.path.exists(os.path.join(path, f.name)):
            report.files.append(FileCheck(os.path.join(path, f.name), f.kind, 0, 0, whole))
            continue
        check = _check(os.path.join(path, f.name))
        if check.error is None and whole is not None:
            check.bad_offset, check.error = 0, whole.split(": ", 1)[1]
        report.files.append(check)
    _recovery(report, path, [f.name for f in manifest.files])
    if report.recovery is not None:
        report.recovery += f"; the manifest says {manifest.shipped_lsn} records shipped"
    return report


def print_report(report: VerifyReport, path: str) -> int:
    for f in report.files:
        print(f.line())
    if not report.files:
        print(f"{path}: no snapshot or log files found")
    if report.recovery is not None:
        print(f"recovers: {report.recovery}")
    if report.unrecoverable is not None:
        print(f"cannot recover: {report.unrecoverable}")
    bad = report.first_bad
    records = sum(f.num_records for f in report.files if f.kind == "log")
    snapshots = sum(f.num_records for f in report.files if f.kind == "snapshot")
    verdict = "all verify" if report.ok else (
        f"first bad: {bad.path} offset {bad.bad_offset}" if bad
        else "records are missing" if report.unrecoverable else "nothing to verify"
    )
    print(f"{snapshots} snapshots, {records} log records; {verdict}")
    return 0 if report.ok else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    v = sub.add_parser("verify", help="check every snapshot and log record of a state or backup dir, or a file")
    v.add_argument("--crc32", action="store_true",
                   help="the field guide's shape: CRC32s are always checked (with a backup's whole-file ones)")
    v.add_argument("path", metavar="PATH", help="state or backup directory, snapshot file or log file")
    r = sub.add_parser("restore", help="write a state directory from a backup directory (--from, --state-dir)")
    r.add_argument("--from", dest="backup", metavar="BACKUP", required=True, help="backup directory")
    r.add_argument("--state-dir", required=True, metavar="DIR", help="the state directory to write")
    r.add_argument("--force", action="store_true", help="replace a non-empty DIR (it is moved aside, not deleted)")
    r.add_argument("--partial", action="store_true",
                   help="a corrupt log segment: restore up to its last good record instead of refusing")


def run(args: argparse.Namespace) -> int:
    path = args.path if args.action == "verify" else args.backup
    if not os.path.exists(path):
        print(f"{path}: no such file or directory", file=sys.stderr)
        return 2
    try:
        if args.action == "restore":
            print(restore(args.backup, args.state_dir, args.force, args.partial).summary())
            return 0
        return print_report(verify(path), path)
    except BackupError as err:
        print(f"checkpoint {args.action}: {err}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet.block_service.checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--verify", metavar="PATH", required=True, help="state directory or file")
    args = parser.parse_args(argv)
    return run(argparse.Namespace(action="verify", path=args.verify))


if __name__ == "__main__":
    sys.exit(main())
