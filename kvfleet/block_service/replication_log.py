"""The leader's recent log records in memory, for standbys to follow. Pure (asyncio only).

    records on disk ──on_durable──▶ [first_lsn ............................. end_lsn)   (framed)
                                       ▲ a standby continues here when its record
                                         first_lsn - 1 .. matches (same CRC)

Only durable records enter (``DurablePageTable.on_durable``), so a standby never holds what the
leader could lose. A standby asks for the records from ``lsn`` on, saying the CRC of its record
``lsn - 1``: when that record is here with the same CRC (or ``lsn`` is the very start) it gets the
records that follow; otherwise (too far behind, its state went another way, it cannot say) the
answer is None and it gets a snapshot instead. A standby fills its own copy from what it applies,
so after a takeover it serves the next standby the same way. At most ``max_bytes`` are kept.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterator

from kvfleet.block_service.recovery import numbered
from kvfleet.block_service.wal import FRAME, frame, frame_crc, scan_log

MAX_BYTES = 64 << 20


def numbered_payloads(state_dir: str) -> Iterator[tuple[int, bytes]]:
    """``(lsn, payload)`` of every record the logs of ``state_dir`` hold, in file order."""
    for _, path in numbered(state_dir, "wal-*.log"):
        scan, records = scan_log(path)
        for i, (_, payload) in enumerate(records):
            yield scan.start_lsn + i, payload


def split_framed(data: bytes) -> list[bytes]:
    """``data`` (whole frames, already verified: they were just written) cut into one per record."""
    out, offset = [], 0
    while offset < len(data):
        n, _ = FRAME.unpack_from(data, offset)
        out.append(data[offset : offset + FRAME.size + n])
        offset += FRAME.size + n
    return out


class ReplicationLog:
    def __init__(self, end_lsn: int = 0, max_bytes: int = MAX_BYTES) -> None:
        self.first_lsn = end_lsn   # lsn of self._frames[0]
        self.max_bytes = max_bytes
        self._frames: deque[bytes] = deque()
        self._bytes = 0
        self._grown = asyncio.Event()

    @property
    def end_lsn(self) -> int:
        return self.first_lsn + len(self._frames)

    @classmethod
    def from_state_dir(cls, state_dir: str, end_lsn: int, max_bytes: int = MAX_BYTES) -> ReplicationLog:
        """The records a restarted replica still has on disk before ``end_lsn`` (so that a standby
        that was following it can continue without a snapshot)."""
        log = cls(end_lsn, max_bytes)
        run: list[bytes] = []
        expected = -1
        for lsn, payload in numbered_payloads(state_dir):  # the gapless run of records ending at end_lsn
            if lsn >= end_lsn:
                break
            if lsn != expected:
                run.clear()
            run.append(frame(payload))
            expected = lsn + 1
        if run and expected == end_lsn:
            log.reset(end_lsn - len(run))
            for framed in run:
                log._push(framed)
        return log

    def reset(self, lsn: int) -> None:
        """The state is now a snapshot at ``lsn``: nothing before it can be continued from here."""
        self._frames.clear()
        self._bytes, self.first_lsn = 0, lsn

    def append(self, end_lsn: int, data: bytes) -> None:
        """Records that became durable, ending at ``end_lsn`` (``on_durable``)."""
        frames = split_framed(data)
        assert end_lsn - len(frames) == self.end_lsn, f"records {end_lsn - len(frames)}.. after {self.end_lsn}"
        for framed in frames:
            self._push(framed)
        self._grown.set()
        self._grown = asyncio.Event()

    def _push(self, framed: bytes) -> None:
        self._frames.append(framed)
        self._bytes += len(framed)
        while self._bytes > self.max_bytes and len(self._frames) > 1:
            self._bytes -= len(self._frames.popleft())
            self.first_lsn += 1

    def prev_crc(self, lsn: int) -> int | None:
        """The CRC of record ``lsn - 1`` when it is here."""
        i = lsn - 1 - self.first_lsn
        return frame_crc(self._frames[i]) if 0 <= i < len(self._frames) else None

    def continues(self, lsn: int, prev_crc: int | None) -> bool:
        """Can a state that ends at ``lsn`` (with that last record) take the records from here?"""
        if lsn > self.end_lsn or lsn < self.first_lsn:
            return False
        if lsn == 0:
            return True
        return prev_crc is not None and self.prev_crc(lsn) == prev_crc

    def read(self, lsn: int, max_bytes: int = 4 << 20) -> bytes | None:
        """Framed records from ``lsn`` on (at least one, up to ``max_bytes``), b"" when there are
        none yet, None when they are no longer here (a snapshot is needed)."""
        if lsn < self.first_lsn:
            return None
        out, size = [], 0
        for i in range(lsn - self.first_lsn, len(self._frames)):
            if out and size + len(self._frames[i]) > max_bytes:
                break
            out.append(self._frames[i])
            size += len(self._frames[i])
        return b"".join(out)

    async def wait_past(self, lsn: int) -> None:
        """Until a record at or after ``lsn`` is here."""
        while self.end_lsn <= lsn:
            await self._grown.wait()
