"""Snapshot files: the whole page table at one log position, with one CRC32 over everything.

    format 2  b"KVFSNAP2" lsn:u64 json_length:u64 num_blobs:u64 json blob_length:u64[num_blobs] blobs crc:u32
    format 1  b"KVFSNAP1" lsn:u64 length:u64 json crc:u32          (still read, no longer written)

    crc = CRC32(all bytes before it)

The JSON is ``PageTable.to_dict()``; in format 2 every ``bytes`` value in it (a pool's arrays,
``pool_codec``) is written as ``{"$b": i}`` and its bytes as blob ``i`` after the JSON, so a
fleet's arrays go to disk and back as they are in memory: no base64, no JSON strings of hundreds
of MB. Reading gives those values back as ``memoryview``s of the file's bytes. A file
of another format is refused with one line naming it. A snapshot is written to a temporary file,
fsynced and renamed, so a crash leaves either the old snapshot or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

from kvfleet.block_service.wal import fsync_dir

MAGIC = b"KVFSNAP2"
MAGIC_V1 = b"KVFSNAP1"
MAGIC_PREFIX = b"KVFSNAP"  # what every format's file starts with
HEADER = struct.Struct("<8sQQQ")
HEADER_V1 = struct.Struct("<8sQQ")
CRC = struct.Struct("<I")
BLOB = "$b"


class SnapshotError(Exception):
    """A snapshot that does not verify; the message says why."""


def snapshot_name(lsn: int) -> str:
    return f"snapshot-{lsn:020d}.snap"


def encode_snapshot(lsn: int, state: dict) -> bytes:
    blobs: list = []

    def blob(value):
        if isinstance(value, (bytes, bytearray, memoryview)):
            blobs.append(value)
            return {BLOB: len(blobs) - 1}
        raise TypeError(f"a snapshot cannot hold {type(value).__name__}")

    text = json.dumps(state, separators=(",", ":"), default=blob).encode()
    lengths = struct.pack(f"<{len(blobs)}Q", *map(len, map(memoryview, blobs)))
    body = b"".join([HEADER.pack(MAGIC, lsn, len(text), len(blobs)), text, lengths, *blobs])
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
    magic = bytes(data[:8])
    if len(data) < HEADER_V1.size + CRC.size or not magic.startswith(MAGIC_PREFIX):
        raise SnapshotError(f"{path}: truncated or not a snapshot ({len(data)} bytes)")
    if magic not in (MAGIC, MAGIC_V1):
        raise SnapshotError(f"{path}: snapshot format {magic[7:].decode(errors='replace')!r} is not one this "
                            f"version reads (1 or 2): written by a newer kvfleet?")
    (crc,) = CRC.unpack_from(data, len(data) - CRC.size)
    if magic == MAGIC_V1:
        _, lsn, length = HEADER_V1.unpack_from(data)
        if HEADER_V1.size + length + CRC.size != len(data):
            raise SnapshotError(f"{path}: length field says {length} bytes of state, file has {len(data)}")
        if zlib.crc32(memoryview(data)[: -CRC.size]) != crc:
            raise SnapshotError(f"{path}: CRC mismatch")
        return lsn, _parse(path, data[HEADER_V1.size : -CRC.size])
    if len(data) < HEADER.size + CRC.size:
        raise SnapshotError(f"{path}: truncated ({len(data)} bytes)")
    _, lsn, length, num_blobs = HEADER.unpack_from(data)
    start = HEADER.size + length + 8 * num_blobs
    if start + CRC.size > len(data):
        raise SnapshotError(f"{path}: length fields say more than the file's {len(data)} bytes")
    sizes = struct.unpack_from(f"<{num_blobs}Q", data, HEADER.size + length)
    if start + sum(sizes) + CRC.size != len(data):
        raise SnapshotError(f"{path}: length fields say {start + sum(sizes) + CRC.size} bytes, file has {len(data)}")
    view = memoryview(data)
    if zlib.crc32(view[: -CRC.size]) != crc:
        raise SnapshotError(f"{path}: CRC mismatch")
    blobs, at = [], start
    for size in sizes:
        blobs.append(view[at : at + size])
        at += size

    def hook(obj: dict):
        if len(obj) == 1 and BLOB in obj:
            i = obj[BLOB]
            if not (type(i) is int and 0 <= i < len(blobs)):
                raise ValueError(f"blob {i!r} of {len(blobs)}")
            return blobs[i]
        return obj

    return lsn, _parse(path, view[HEADER.size : HEADER.size + length], hook)


def _parse(path: str, text, hook=None) -> dict:
    try:
        return json.loads(bytes(text), object_hook=hook)
    except ValueError as err:  # CRC matched but the JSON does not parse: a writer bug
        raise SnapshotError(f"{path}: state does not parse: {err}") from None
