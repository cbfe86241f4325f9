"""The disk tier: a directory of memory-mapped block files, one per slot, each checksummed.

The directory is this node's own scratch space: its block files are wiped when the node starts
(the index of what they hold lives in memory, so files from an earlier life name nothing). A file
is allocated in full before it is mapped (``posix_fallocate``), so a full disk is an ``OSError``
here instead of a SIGBUS in the middle of a copy. Each write keeps the block's CRC32; a read
whose file is short, missing or whose bytes do not match answers None: the block is dropped and
recomputed, never served.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import numpy as np

PREFIX, SUFFIX = "block-", ".kv"


class DiskPool:
    def __init__(self, directory: str | Path, block_bytes: int) -> None:
        self.directory = Path(directory)
        self.block_bytes = block_bytes
        self._crc: dict[int, int] = {}
        self.directory.mkdir(parents=True, exist_ok=True)
        for old in self.directory.glob(f"{PREFIX}*{SUFFIX}"):
            old.unlink()

    def path(self, slot: int) -> Path:
        return self.directory / f"{PREFIX}{slot:07d}{SUFFIX}"

    def write(self, slot: int, data: np.ndarray) -> None:
        """Store one block's bytes in ``slot``'s file; ``OSError`` when the disk cannot take it."""
        path = self.path(slot)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, self.block_bytes)
        finally:
            os.close(fd)
        mapped = np.memmap(path, dtype=np.uint8, mode="r+", shape=(self.block_bytes,))
        mapped[:] = data
        mapped.flush()
        del mapped
        self._crc[slot] = zlib.crc32(data)

    def read(self, slot: int) -> np.ndarray | None:
        """``slot``'s block as written, or None when its file was lost, truncated or corrupted."""
        path = self.path(slot)
        expected = self._crc.get(slot)
        try:
            if expected is None or path.stat().st_size != self.block_bytes:
                return None
            data = np.array(np.memmap(path, dtype=np.uint8, mode="r", shape=(self.block_bytes,)))
        except (OSError, ValueError):
            return None
        return data if zlib.crc32(data) == expected else None
