"""Snapshot files: the whole page table at one log position, with one CRC32 over everything.

    file = b"KVFSNAP1" lsn:u64 length:u64 payload[length] crc:u32   crc = CRC32(all bytes before it)

``payload`` is the JSON of ``PageTable.to_dict()``. A snapshot is written to a temporary file,
fsynced and renamed, so a crash leaves either the old snapshot or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

from block_service.wal import fsync_dir

MAGIC = b"KVFSNAP1"
HEADER = struct.Struct("<8sQQ")
CRC = struct.Struct("<I")


class SnapshotError(Exception):
    """A snapshot that does not verify; the message says why."""


def snapshot_name(lsn: int) -> str:
    return f"snapshot-{lsn:020d}.snap"


def encode_snapshot(lsn: int, state: dict) -> bytes:
    payload = json.dumps(state, separators=(",", ":")).encode()
    body = HEADER.pack(MAGIC, lsn, len(payload)) + payload
    return body + CRC.pack(zlib.crc32(body))


def write_atomically(directory: str, name: str, data: bytes, fsync: bool = True) -> str:
    """Write ``data`` to a temporary file, fsync it, rename it to ``name``: a crash leaves the old
    file or the new one, never half of one. Returns the path."""
    path = os.path.join(directory, name)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(directory)
    return path


def write_snapshot(state_dir: str, lsn: int, state: dict, fsync: bool = True) -> str:
    return write_atomically(state_dir, snapshot_name(lsn), encode_snapshot(lsn, state), fsync)


def read_snapshot(path: str) -> tuple[int, dict]:
    """``(lsn, state)``; raises ``SnapshotError`` when the file does not verify."""
    with open(path, "rb") as f:
        return decode_snapshot(f.read(), path)


def decode_snapshot(data: bytes, where: str = "snapshot") -> tuple[int, dict]:
    """``(lsn, state)`` from a snapshot's bytes (a file, or a replication stream's parts);
    raises ``SnapshotError`` (its message starting with ``where``) when they do not verify."""
    path = where
    if len(data) < HEADER.size + CRC.size or data[:8] != MAGIC:
        raise SnapshotError(f"{path}: truncated or not a snapshot ({len(data)} bytes)")
    _, lsn, length = HEADER.unpack_from(data)
    if HEADER.size + length + CRC.size != len(data):
        raise SnapshotError(f"{path}: length field says {length} bytes of state, file has {len(data)}")
    (crc,) = CRC.unpack_from(data, len(data) - CRC.size)
    if zlib.crc32(memoryview(data)[: -CRC.size]) != crc:
        raise SnapshotError(f"{path}: CRC mismatch")
    try:
        return lsn, json.loads(data[HEADER.size : -CRC.size])
    except ValueError as err:  # CRC matched but the JSON does not parse: a writer bug
        raise SnapshotError(f"{path}: state does not parse: {err}") from None
