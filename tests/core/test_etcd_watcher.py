"""A watch creation that timed out must not bind its late answer to the next watch created
(kvfleet.core.etcd_watcher): aetcd's own Watcher did, and the next watch then got another key range's
events and never its own (the partition bed's lossy soak: a deposed leader blind to the new one).
In-process: a fake Watch stream, answered by hand."""

import asyncio

import pytest
from aetcd import exceptions, rpc
from aetcd.rpc import kv_pb2

from kvfleet.core.etcd_watcher import Watcher


class _Stream:
    """The Watch RPC's two directions: the requests the watcher sent, the answers the test gives."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue = asyncio.Queue()
        self.answers: asyncio.Queue = asyncio.Queue()
        self._auto = iter(range(100, 200))

    def assign(self, create: rpc.WatchCreateRequest) -> int:
        """The id etcd gives a creation: the one it asked for, else the stream's next (etcd 3.4+)."""
        return create.watch_id or next(self._auto)

    def Watch(self, request_iterator, metadata=None):  # noqa: N802 - the stub's method name
        async def pump():
            async for request in request_iterator:
                await self.requests.put(request)

        async def responses():
            task = asyncio.ensure_future(pump())
            try:
                while (answer := await self.answers.get()) is not None:
                    yield answer
            finally:
                task.cancel()
        return responses()

    async def sent(self) -> rpc.WatchRequest:
        return await asyncio.wait_for(self.requests.get(), 2)


def _created(watch_id: int) -> rpc.WatchResponse:
    return rpc.WatchResponse(watch_id=watch_id, created=True)


def _put(watch_id: int, key: bytes) -> rpc.WatchResponse:
    event = kv_pb2.Event(type=kv_pb2.Event.PUT, kv=kv_pb2.KeyValue(key=key, value=b"v"))
    return rpc.WatchResponse(watch_id=watch_id, events=[event])


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_late_answer_to_a_creation_given_up_on_binds_no_other_watch():
    async def scenario():
        stream = _Stream()
        watcher = Watcher(stream, timeout=0.05)
        got_nodes, got_leader = [], []

        async def on_nodes(event):
            got_nodes.append(event)

        async def on_leader(event):
            got_leader.append(event)

        with pytest.raises(exceptions.WatchTimeoutError):  # no answer in time: given up on
            await watcher.add_callback(b"/kvfleet/nodes/", on_nodes)
        first = stream.assign((await stream.sent()).create_request)

        leader = asyncio.ensure_future(watcher.add_callback(b"/kvfleet/block_service/leader", on_leader))
        second = stream.assign((await stream.sent()).create_request)
        assert second != first

        await stream.answers.put(_created(first))  # the first creation's answer, late
        await _settle()
        assert not leader.done()  # still waiting for its own answer
        assert (await stream.sent()).cancel_request.watch_id == first

        await stream.answers.put(_created(second))
        bound = await asyncio.wait_for(leader, 2)
        assert bound.watch_id == second

        await stream.answers.put(_put(first, b"/kvfleet/nodes/node-0"))
        await stream.answers.put(_put(second, b"/kvfleet/block_service/leader"))
        await _settle()
        assert [e.kv.key for e in got_leader] == [b"/kvfleet/block_service/leader"]
        assert got_nodes == []
        await stream.answers.put(None)
        await watcher.shutdown()

    asyncio.run(scenario())


def test_every_creation_asks_for_an_id_of_its_own():
    async def scenario():
        stream = _Stream()
        watcher = Watcher(stream, timeout=2)
        ids = []
        for key in (b"/a", b"/b", b"/c"):
            task = asyncio.ensure_future(watcher.add_callback(key, lambda e: None, watch_id=7))
            request = (await stream.sent()).create_request
            ids.append(request.watch_id)
            await stream.answers.put(_created(request.watch_id))
            assert (await asyncio.wait_for(task, 2)).watch_id == request.watch_id
        assert len(set(ids)) == 3 and 0 not in ids
        await stream.answers.put(None)
        await watcher.shutdown()

    asyncio.run(scenario())
