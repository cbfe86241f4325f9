"""The write-ahead log file: framed records, each with its own CRC32.

    file   = header frame*
    header = b"KVFWAL01" start_lsn:u64          (lsn: number of records since the first start)
    frame  = length:u32 crc:u32 payload[length]  crc = CRC32(length bytes + payload)

All integers little-endian. A reader stops at the first frame that is short (torn write), too long
or fails its CRC, and says where; nothing after that point is trusted.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

MAGIC = b"KVFWAL01"
HEADER = struct.Struct("<8sQ")
FRAME = struct.Struct("<II")
MAX_RECORD_BYTES = 1 << 30  # far above any RPC (64 MiB at most); beyond it: garbage length


def frame(payload: bytes) -> bytes:
    n = len(payload)
    assert n <= MAX_RECORD_BYTES, f"log record of {n} bytes"
    length = n.to_bytes(4, "little")
    return length + zlib.crc32(payload, zlib.crc32(length)).to_bytes(4, "little") + payload


class FrameError(ValueError):
    """Framed records that do not verify (short, too long, or a CRC mismatch): nothing in them is
    trusted. The message says which record and why."""


def read_frames(data: bytes) -> list[bytes]:
    """The payloads of ``data``, a run of whole frames (a replication message); raises
    ``FrameError`` at the first one that does not verify, before any is returned."""
    payloads, offset, view = [], 0, memoryview(data)
    while offset < len(data):
        if offset + FRAME.size > len(data):
            raise FrameError(f"record {len(payloads)}: torn header at byte {offset}")
        n, crc = FRAME.unpack_from(data, offset)
        end = offset + FRAME.size + n
        if n > MAX_RECORD_BYTES or end > len(data):
            raise FrameError(f"record {len(payloads)}: length {n} runs past the {len(data)} bytes sent")
        payload = bytes(view[offset + FRAME.size : end])
        if zlib.crc32(payload, zlib.crc32(view[offset : offset + 4])) != crc:
            raise FrameError(f"record {len(payloads)}: CRC mismatch")
        payloads.append(payload)
        offset = end
    return payloads


def frame_crc(framed: bytes) -> int:
    """The CRC field of one framed record."""
    return FRAME.unpack_from(framed)[1]


def log_name(start_lsn: int) -> str:
    return f"wal-{start_lsn:020d}.log"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LogWriter:
    """Appends framed bytes to one log file; ``write`` returns once they are on disk (if fsync)."""

    def __init__(self, path: str, start_lsn: int, fsync: bool = True) -> None:
        self.path = path
        self.start_lsn = start_lsn
        self.fsync = fsync
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        self.size = 0
        self.write(HEADER.pack(MAGIC, start_lsn))
        if fsync:
            fsync_dir(os.path.dirname(path) or ".")

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        self.size += len(data)
        if self.fsync:
            os.fdatasync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(slots=True)
class LogScan:
    """What a reader found in one log file; ``records`` yields ``(offset, payload)``."""

    path: str
    start_lsn: int
    num_records: int = 0
    end_offset: int = 0        # where the valid data ends
    error: str | None = None   # why reading stopped before the end of the file
    file_size: int = 0


def scan_log(path: str) -> tuple[LogScan, Iterator[tuple[int, bytes]]]:
    """Open a log; iterate the returned records to fill in the scan (counts, first bad offset)."""
    f = open(path, "rb")
    size = os.fstat(f.fileno()).st_size
    head = f.read(HEADER.size)
    scan = LogScan(path, -1, file_size=size)
    if len(head) < HEADER.size or head[:8] != MAGIC:
        f.close()
        scan.error = "torn or foreign log header at offset 0"
        return scan, iter(())
    scan.start_lsn = HEADER.unpack(head)[1]
    scan.end_offset = HEADER.size
    return scan, _records(f, scan)


def _records(f, scan: LogScan) -> Iterator[tuple[int, bytes]]:
    with f:
        offset = scan.end_offset
        while offset < scan.file_size:
            head = f.read(FRAME.size)
            if len(head) < FRAME.size:
                scan.error = f"torn record header at offset {offset}"
                return
            n, crc = FRAME.unpack(head)
            if n > MAX_RECORD_BYTES:
                scan.error = f"record length {n} out of range at offset {offset}"
                return
            payload = f.read(n)
            if len(payload) < n:
                scan.error = f"torn record at offset {offset} ({len(payload)} of {n} bytes)"
                return
            if zlib.crc32(payload, zlib.crc32(head[:4])) != crc:
                scan.error = f"CRC mismatch at offset {offset}"
                return
            yield offset, payload
            offset += FRAME.size + n
            scan.num_records += 1
            scan.end_offset = offset
