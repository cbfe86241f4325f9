"""The leader's durable record count in etcd, so that a replica behind it never leads.

The election key says who leads; it does not say how far the history goes. Leader A dies, standby B
takes over and acknowledges more records, B dies, A restarts: A would win the next election with a
state that lacks B's records, and serve it. So the leader writes ``{lineage, lsn}`` (the records
durable on it) under ``DURABLE_KEY`` every third of the lease TTL, and a replica whose state does
not hold that history (another lineage, an empty directory, or fewer records) waits for a replica
that does (or for an operator) instead of campaigning; one that holds it may lead, ``--standby`` or
not, so the fleet comes back whichever replica returns first. A change acknowledged while a standby
in sync holds it is safe without a mark (the standby has it); one acknowledged with no standby in
sync (``--sync-standby`` degraded to async: none connected, or one that fell behind) waits for a
mark that covers it (``MarkWriter.cover``): before, the records acknowledged since the last periodic
mark were a window (a third of the TTL, wider on a lossy link where the marks lag) in which a standby
that took over lacked them and granted their blocks again (the partition bed's lossy soak, 200 ms
delay and 10% loss: 3 acknowledged writes lost, 2 blocks granted twice).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aetcd

from kvfleet.core.errors import Unavailable

DURABLE_KEY = "/kvfleet/block_service/durable"


def parse_mark(mark: bytes | None) -> tuple[str, int] | None:
    """``(lineage, lsn)`` of a mark; None for none or a garbled one (which holds no replica back)."""
    try:
        value = json.loads(mark)
        return str(value["lineage"]), int(value["lsn"])
    except (ValueError, KeyError, TypeError):
        return None


def behind(mark: bytes | None, lineage: str | None, lsn: int) -> int | None:
    """The mark's record count when a state of ``lineage`` (None: an empty directory) ending at
    ``lsn`` lacks records the mark names; None when it holds them all. Pure."""
    parsed = parse_mark(mark)
    if parsed is None:
        return None
    theirs, their_lsn = parsed
    return their_lsn if theirs != lineage or lsn < their_lsn else None


async def read_mark(client: aetcd.Client) -> bytes | None:
    found = await client.get(DURABLE_KEY.encode())
    return found.value if found is not None else None


COVER_TIMEOUT_S = 5.0  # a mark not in etcd by then: the change is answered UNAVAILABLE, not acknowledged


class MarkWriter:
    """The leader's marks: the durable record count whenever it moved, at most every ``every_s``
    (``run``), and on demand for a change acknowledged with no standby in sync (``cover``)."""

    def __init__(self, client: aetcd.Client, lineage: str, durable_lsn: Callable[[], int]) -> None:
        self.client, self.lineage, self.durable_lsn = client, lineage, durable_lsn
        self.written = -1
        self._lock = asyncio.Lock()  # one put at a time; the changes waiting meanwhile share the next

    async def _write(self) -> None:
        lsn = self.durable_lsn()
        await self.client.put(DURABLE_KEY.encode(), json.dumps({"lineage": self.lineage, "lsn": lsn}).encode())
        self.written = max(self.written, lsn)

    async def cover(self, lsn: int) -> None:
        """Return once etcd holds a mark of at least ``lsn`` records; ``Unavailable`` (one line) when
        it cannot be written within ``COVER_TIMEOUT_S``: the change is then not acknowledged."""
        if self.written >= lsn:
            return
        try:
            async with asyncio.timeout(COVER_TIMEOUT_S), self._lock:
                if self.written < lsn:
                    await self._write()
        except Exception as e:  # noqa: BLE001 - etcd unreachable, timed out, refused: not acknowledged
            raise Unavailable(f"no standby in sync and the durable mark could not be written to etcd "
                              f"({type(e).__name__}): the change is not acknowledged") from e

    async def run(self, every_s: float) -> None:
        while True:
            if self.durable_lsn() != self.written:
                async with self._lock:
                    await self._write()
            await asyncio.sleep(every_s)
