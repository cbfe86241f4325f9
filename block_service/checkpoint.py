"""Verify a state directory, snapshot or log: every snapshot's CRC, every log record's CRC and form.

    kvfleet checkpoint verify PATH
    python -m block_service.checkpoint --verify PATH

Prints one line per file (records counted, first bad offset), then for a state directory what
block_service would recover from it — or why it would refuse to start, in the same words — and exits
0 only when every file verifies and the state recovers.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from dataclasses import dataclass, field

from block_service import wal_records
from block_service.durable import RecoveryError, recover
from block_service.snapshot import MAGIC as SNAPSHOT_MAGIC
from block_service.snapshot import SnapshotError, read_snapshot
from block_service.wal import scan_log


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
    if os.path.isdir(path):
        paths = sorted(glob.glob(os.path.join(path, "*.snap")) + glob.glob(os.path.join(path, "*.log")))
    else:
        paths = [path]
    for p in paths:
        with open(p, "rb") as f:
            is_snapshot = f.read(len(SNAPSHOT_MAGIC)) == SNAPSHOT_MAGIC or p.endswith(".snap")
        report.files.append(check_snapshot(p) if is_snapshot else check_log(p))
    if os.path.isdir(path) and report.files:
        try:
            report.recovery = recover(path)[1].summary()
        except RecoveryError as err:
            report.unrecoverable = str(err)
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
    v = sub.add_parser("verify", help="check every snapshot and log record of a state dir or file")
    v.add_argument("path", metavar="PATH", help="state directory, snapshot file or log file")


def run(args: argparse.Namespace) -> int:
    if not os.path.exists(args.path):
        print(f"{args.path}: no such file or directory", file=sys.stderr)
        return 2
    return print_report(verify(args.path), args.path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m block_service.checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--verify", metavar="PATH", required=True, help="state directory or file")
    args = parser.parse_args(argv)
    return run(argparse.Namespace(action="verify", path=args.verify))


if __name__ == "__main__":
    sys.exit(main())
