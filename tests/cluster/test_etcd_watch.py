"""The one list/watch/relist loop (kvfleet.core.etcd_watch) against a real etcd: what membership and the
block_service leader follow (the ``etcd`` fixture: conftest.py)."""

from __future__ import annotations

import asyncio
import time

from kvfleet.core.etcd_watch import Change, Listed, follow_prefix
from kvfleet.core.leader import Leader, watch_leader
from kvfleet.core.membership import etcd_client, watch_nodes


async def _next(events, timeout=10.0):
    return await asyncio.wait_for(anext(events), timeout)


async def _put_once_up(url: str, key: bytes, value: bytes, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with etcd_client(url, timeout=1.0) as client:
        while True:
            try:
                await client.put(key, value)
                return
            except Exception:  # still starting
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


def test_a_listing_then_live_changes_then_the_difference_after_a_break(etcd):
    prefix = "/kvfleet/test-watch/"

    async def main():
        async with etcd_client(etcd.url) as client:
            await client.put(f"{prefix}a".encode(), b"1")
            events = follow_prefix(client, prefix, "test keys", retry_s=0.2)
            assert await _next(events) == Change("a", b"1", listed=True)
            assert isinstance(await _next(events), Listed)
            await client.put(f"{prefix}b".encode(), b"2")
            assert await _next(events) == Change("b", b"2")
            await client.delete(f"{prefix}a".encode())
            assert await _next(events) == Change("a", None)
            etcd.process.kill()  # the watch breaks; what changed meanwhile comes as a difference
            etcd.process.wait()
            etcd.restart()
            await _put_once_up(etcd.url, f"{prefix}c".encode(), b"3")
            seen = [await _next(events, 30.0)]
            while not isinstance(seen[-1], Listed):
                seen.append(await _next(events))
            assert seen[:-1] == [Change("c", b"3", listed=True)]  # b unchanged: not yielded again
            await events.aclose()

    asyncio.run(main())


def test_the_leader_is_said_at_once_even_when_nobody_leads(etcd):
    async def main():
        async with etcd_client(etcd.url) as client:
            leaders = watch_leader(client, key="/kvfleet/test-leader", retry_s=0.2)
            assert await _next(leaders) is None
            await client.put(b"/kvfleet/test-leader-2", b"not a leader")  # shares the prefix: passed over
            await client.put(b"/kvfleet/test-leader", Leader("a:1", "L").to_json())
            assert await _next(leaders) == Leader("a:1", "L")
            await client.delete(b"/kvfleet/test-leader")
            assert await _next(leaders) is None
            await leaders.aclose()

    asyncio.run(main())


def test_closing_a_watch_while_etcd_is_down_does_not_hang(etcd):
    """etcd gone under a live watch: closing the consumer ends the loop (the watch's cancel is bounded
    by CANCEL_TIMEOUT_S; a stream that never came up may not answer it at all)."""
    async def main():
        async with etcd_client(etcd.url, timeout=1.0) as client:
            changes = watch_nodes(client, "/kvfleet/test-hang/", retry_s=0.2)
            pending = asyncio.ensure_future(_next(changes, 60.0))  # listed (nothing), watching
            await asyncio.sleep(1.0)
            etcd.process.kill()
            etcd.process.wait()
            await asyncio.sleep(1.0)
            start = time.monotonic()
            pending.cancel()
            await asyncio.wait_for(asyncio.gather(pending, return_exceptions=True), 20.0)
            await asyncio.wait_for(changes.aclose(), 20.0)
            return time.monotonic() - start

    try:
        assert asyncio.run(main()) < 20.0
    finally:
        etcd.restart()
