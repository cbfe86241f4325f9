"""The leader's durable record count in etcd, so that a replica behind it never leads.

The election key says who leads; it does not say how far the history goes. Leader A dies, standby B
takes over and acknowledges more records, B dies, A restarts: A would win the next election with a
state that lacks B's records, and serve it. So the leader writes ``{lineage, lsn}`` (the records
durable on it) under ``DURABLE_KEY`` every third of the lease TTL, and a replica whose state does
not hold that history (another lineage, an empty directory, or fewer records) waits for a replica
that does (or for an operator) instead of campaigning; one that holds it may lead, ``--standby`` or
not, so the fleet comes back whichever replica returns first. Records acknowledged after the last
mark written are the one window left (a third of the lease TTL).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aetcd

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


async def publish_marks(client: aetcd.Client, lineage: str, durable_lsn: Callable[[], int], every_s: float) -> None:
    """While leading: the durable record count, whenever it moved, at most every ``every_s``."""
    written = None
    while True:
        lsn = durable_lsn()
        if lsn != written:
            await client.put(DURABLE_KEY.encode(), json.dumps({"lineage": lineage, "lsn": lsn}).encode())
            written = lsn
        await asyncio.sleep(every_s)
