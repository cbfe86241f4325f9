"""How a node's Serve stream batches events: a step's events in one message, a lagging reader's
chunks merged per request, errors kept in order. Pure logic, no server."""

from __future__ import annotations

import asyncio

import grpc

from kvfleet.compute_service.node.request_stream import error_event
from kvfleet.compute_service.node.serve_session import ServeSession
from kvfleet.v1 import compute_pb2, inference_pb2


def chunk(request_id, tokens, text="", finish=0, usage=None):
    event = compute_pb2.RequestEvent(request_id=request_id, chunk=compute_pb2.ComputeChunk(
        token_ids=tokens, text=text, finish_reason=finish))
    if usage is not None:
        event.chunk.usage.CopyFrom(inference_pb2.Usage(prompt_tokens=usage[0], completion_tokens=usage[1]))
    return event


def test_events_queued_before_a_read_go_out_as_one_message_merged_per_request():
    async def main():
        session = ServeSession(node=None)
        session.emit(chunk("a", [1], "x"))
        session.emit(chunk("b", [5], "y"))
        session.emit(chunk("a", [2], "z", finish=inference_pb2.FINISH_REASON_LENGTH, usage=(3, 2)))
        first = await session.next_events()
        session.emit(chunk("b", [6]))
        session.emit(error_event("b", grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", "quota"))
        session.emit(chunk("c", [9]))
        second = await session.next_events()
        session.close()
        return first, second, await session.next_events()

    first, second, after_close = asyncio.run(main())
    a, b = first.events
    assert (a.request_id, list(a.chunk.token_ids), a.chunk.text) == ("a", [1, 2], "xz")
    assert a.chunk.finish_reason == inference_pb2.FINISH_REASON_LENGTH and a.chunk.usage.completion_tokens == 2
    assert (b.request_id, list(b.chunk.token_ids)) == ("b", [5])
    # b's token before its error, in order; c's chunk is not merged into anything
    assert [(e.request_id, e.WhichOneof("event")) for e in second.events] == [("b", "chunk"), ("b", "error"), ("c", "chunk")]
    assert second.events[1].error.refusal == "quota"
    assert second.events[1].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert after_close is None


def test_a_reader_waits_for_the_next_event():
    async def main():
        session = ServeSession(node=None)
        reader = asyncio.ensure_future(session.next_events())
        await asyncio.sleep(0.01)
        assert not reader.done()
        session.emit(chunk("a", [1]))
        return await asyncio.wait_for(reader, 1)

    assert [e.request_id for e in asyncio.run(main()).events] == ["a"]
