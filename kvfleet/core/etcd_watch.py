"""Following keys in etcd without gaps: list, watch from the listing's revision, and on a break
list again and yield the difference. The one loop behind membership (``kvfleet.core.membership``) and
the block_service leader (``kvfleet.core.leader``).

    get_prefix (revision r) ─▶ Change per key that differs from what was yielded, then Listed
            │                                                                  │
            └──── watch_prefix from r + 1 ─▶ Change per event ─── breaks ──────┘ (after retry_s)

A watch whose stream is not up yet may never answer its cancel (etcd down): the cancel is bounded
by ``CANCEL_TIMEOUT_S``, or a consumer closing the loop would hang on it. A cancel of the task that
reaches the loop as an etcd error (aetcd maps a gRPC call cancelled under it to an exception of its
own) or that Python 3.11's ``wait_for`` loses is still a cancel: the loop ends when its task has one
pending (``Task.cancelling``), not only on ``CancelledError``. Seen: a node told to stop with etcd
gone kept listing every second for an hour, its shutdown waiting on this loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aetcd

from kvfleet.core.backoff import LogThrottle, error_line

log = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 2.0


@dataclass(slots=True, frozen=True)
class Change:
    key: str              # the key without the prefix
    value: bytes | None   # None: deleted (or its lease expired)
    listed: bool = False  # from a listing (the start or after a break), not a live event


@dataclass(slots=True, frozen=True)
class Listed:
    """A listing's changes were all yielded: the consumer's view equals etcd's at that revision."""

    revision: int


async def follow_prefix(client: aetcd.Client, prefix: str, what: str, retry_s: float = 1.0
                        ) -> AsyncIterator[Change | Listed]:
    """Every key under ``prefix`` now, then every change, forever (``what`` names it in the log)."""
    known: dict[str, bytes] = {}
    throttle = LogThrottle()  # etcd down: one line every few seconds, not one per retry
    while True:
        try:
            result = await client.get_prefix(prefix.encode())
            listed = {kv.key.decode()[len(prefix):]: kv.value for kv in result}
            for key in [k for k in known if k not in listed]:
                del known[key]
                yield Change(key, None, listed=True)
            for key, value in listed.items():
                if known.get(key) != value:
                    known[key] = value
                    yield Change(key, value, listed=True)
            yield Listed(result.header.revision)
            watch = await client.watch_prefix(prefix.encode(), start_revision=result.header.revision + 1)
            try:
                async for event in watch:
                    key = event.kv.key.decode()[len(prefix):]
                    if event.kind == aetcd.EventKind.DELETE:
                        if known.pop(key, None) is not None:
                            yield Change(key, None)
                    else:
                        known[key] = event.kv.value
                        yield Change(key, event.kv.value)
            finally:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(watch.cancel(), CANCEL_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # etcd restarted or unreachable, history compacted: list again
            raise_if_cancelled()
            if throttle.due():
                log.warning("watch of %s in etcd broke (%s); listing it again every %.1fs",
                            what, error_line(e), retry_s)
        raise_if_cancelled()
        await asyncio.sleep(retry_s)


def raise_if_cancelled() -> None:
    """``CancelledError`` when the running task has a cancel pending that something swallowed on
    its way here (an exception of the etcd client's for the cancelled call, 3.11's ``wait_for``)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
