"""Disaster recovery: ship block_service's state to a backup directory, the latest full snapshot
plus the log segments since, each file with its CRC32 in a manifest.

    backup-dir/
      snapshot-<lsn>.snap   a copy of the newest snapshot of the state directory
      wal-<lsn>.log         records <lsn>.. up to the next segment (the WAL's own format)
      MANIFEST.json         every file above: kind, first and end record, size, CRC32 of the whole file

The backup directory is laid out as a state directory, so ``durable.recover`` reads it; files the
manifest does not list (a ship that crashed before its manifest) are ignored and deleted by the next
ship. Every file is written to a temporary name, fsynced and renamed, the manifest last: a crash at
any point leaves the previous backup whole. The per-record CRCs of the log find a corrupt record;
the whole-file CRC32 also finds a segment cut at a record boundary, which per-record CRCs cannot.

A segment always starts at the backup's snapshot or where the previous one ended, so recovery needs
no record from before the snapshot (``recover`` skips logs that start before it). When the state
directory has a newer snapshot, the ship copies it and writes one segment from it on, replacing the
old snapshot and segments.
"""

from __future__ import annotations

import json
import os
import time
import zlib
from dataclasses import asdict, dataclass, field

from kvfleet.block_service.recovery import numbered
from kvfleet.block_service.snapshot import SnapshotError, read_snapshot, write_atomically
from kvfleet.block_service.wal import HEADER, MAGIC, frame, log_name, scan_log

MANIFEST = "MANIFEST.json"
FORMAT = 1


class BackupError(Exception):
    """A backup that cannot be written or used; the message (one line) names the file and why."""


@dataclass(slots=True)
class BackupFile:
    name: str
    kind: str          # "snapshot" or "log"
    start_lsn: int     # snapshot: its record; log: its first record
    end_lsn: int       # snapshot: its record; log: one past its last record
    size: int
    crc32: int


@dataclass(slots=True)
class Manifest:
    files: list[BackupFile] = field(default_factory=list)
    shipped_lsn: int = 0          # records in the backup: the state it restores to
    shipped_at: float = 0.0       # wall-clock time of the last ship (for a person)

    @property
    def snapshot(self) -> BackupFile | None:
        return next((f for f in self.files if f.kind == "snapshot"), None)

    def to_json(self) -> bytes:
        return json.dumps({"format": FORMAT, "shipped_lsn": self.shipped_lsn, "shipped_at": self.shipped_at,
                           "files": [asdict(f) for f in self.files]}, indent=1).encode()


def read_manifest(backup_dir: str) -> Manifest | None:
    """The backup's manifest, None when the directory has none; ``BackupError`` when unreadable."""
    path = os.path.join(backup_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
        if d.get("format") != FORMAT:
            raise ValueError(f"format {d.get('format')!r}, expected {FORMAT}")
        return Manifest([BackupFile(**f) for f in d["files"]], d["shipped_lsn"], d["shipped_at"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as err:
        raise BackupError(f"{path}: not a backup manifest: {err}") from None


def file_crc32(path: str) -> tuple[int, int]:
    """``(size, crc32)`` of a whole file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def check_file(backup_dir: str, f: BackupFile) -> str | None:
    """None when the file is there with the manifest's size and CRC32, else why not."""
    path = os.path.join(backup_dir, f.name)
    if not os.path.exists(path):
        return f"{path}: missing (the manifest lists it)"
    size, crc = file_crc32(path)
    if size != f.size:
        return f"{path}: {size} bytes, the manifest says {f.size}"
    if crc != f.crc32:
        return f"{path}: CRC32 {crc:08x}, the manifest says {f.crc32:08x}"
    return None


def _newest_snapshot(state_dir: str) -> tuple[int, str]:
    for lsn, path in reversed(numbered(state_dir, "snapshot-*.snap")):
        try:
            read_snapshot(path)
            return lsn, path
        except SnapshotError:
            continue
    raise BackupError(f"{state_dir}: no snapshot that verifies to ship")


def _records(state_dir: str, start: int, end: int) -> bytes:
    """The framed records ``start..end-1`` from the state directory's logs."""
    out = bytearray()
    expected = start
    logs = numbered(state_dir, "wal-*.log")
    for i, (first, path) in enumerate(logs):
        if first >= end or (i + 1 < len(logs) and logs[i + 1][0] <= start):
            continue  # wholly outside the range
        scan, records = scan_log(path)
        lsn = scan.start_lsn
        if lsn == -1:  # a torn header: a log created as the process died, holding no record
            continue
        try:
            for _, payload in records:
                if lsn >= end:
                    break
                if lsn == expected:
                    out += frame(payload)
                    expected += 1
                lsn += 1
        finally:
            records.close()
    if expected != end:
        raise BackupError(f"{state_dir}: records {expected}..{end - 1} are in no log to ship")
    return bytes(out)


@dataclass(slots=True)
class ShipResult:
    snapshot: str | None = None       # the snapshot copied, if a newer one was
    segment: str | None = None        # the segment written, if any record was new
    first_lsn: int = 0
    shipped_lsn: int = 0

    def summary(self) -> str:
        parts = [f"snapshot {self.snapshot}"] if self.snapshot else []
        if self.segment:
            parts.append(f"records {self.first_lsn}..{self.shipped_lsn - 1} as {self.segment}")
        return ", ".join(parts) or f"nothing new (at record {self.shipped_lsn})"


def ship(target_lsn: int, state_dir: str, backup_dir: str, fsync: bool = True) -> ShipResult:
    """Bring ``backup_dir`` up to record ``target_lsn`` (durable in ``state_dir``): copy a newer
    snapshot, write the records since as one segment, then the manifest. Blocking: run it in a
    thread while no snapshot rotates the log (``DurablePageTable.run_exclusive``)."""
    os.makedirs(backup_dir, exist_ok=True)
    manifest = read_manifest(backup_dir) or Manifest()
    base = manifest.snapshot
    snap_lsn, snap_path = _newest_snapshot(state_dir)
    result = ShipResult(shipped_lsn=manifest.shipped_lsn)
    files = list(manifest.files)
    start = manifest.shipped_lsn
    if base is None or snap_lsn > base.start_lsn:
        with open(snap_path, "rb") as f:
            data = f.read()
        name = os.path.basename(snap_path)
        write_atomically(backup_dir, name, data, fsync)
        files = [BackupFile(name, "snapshot", snap_lsn, snap_lsn, len(data), zlib.crc32(data))]
        start = result.shipped_lsn = snap_lsn
        result.snapshot = name
    if target_lsn > start:
        data = HEADER.pack(MAGIC, start) + _records(state_dir, start, target_lsn)
        name = log_name(start)
        write_atomically(backup_dir, name, data, fsync)
        files.append(BackupFile(name, "log", start, target_lsn, len(data), zlib.crc32(data)))
        result.segment, result.first_lsn, result.shipped_lsn = name, start, target_lsn
    if result.snapshot is None and result.segment is None:
        return result
    manifest = Manifest(files, result.shipped_lsn, time.time())
    write_atomically(backup_dir, MANIFEST, manifest.to_json(), fsync)
    keep = {f.name for f in files} | {MANIFEST}
    for name in os.listdir(backup_dir):
        if name not in keep and (name.endswith((".snap", ".log", ".tmp"))):
            os.remove(os.path.join(backup_dir, name))
    return result
