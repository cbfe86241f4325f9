"""One router's Serve stream on this node: the requests it started and the events owed to it.

Commands come in one at a time (start, cancel); events go out batched. Every request's events of
an engine step are emitted in the same event-loop round (``AsyncEngine`` hands a step's outputs
over in one callback round), so the writer wakes once and sends them as one ``NodeEvents``. When
the router reads slower than the engine steps, a request's chunks waiting to be sent merge into
one, so a slow reader costs fewer, larger messages, not a growing backlog of small ones.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvfleet.compute_service.node.context import NodeContext
from kvfleet.compute_service.node.request_stream import RequestStream, error_event
from kvfleet.v1 import compute_pb2

log = logging.getLogger(__name__)


class ServeSession:
    def __init__(self, node: NodeContext):
        self.node = node
        self.requests: dict[str, RequestStream] = {}
        self._starting: set[asyncio.Task] = set()
        self._events: list[compute_pb2.RequestEvent] = []
        self._open_chunk: dict[str, compute_pb2.ComputeChunk] = {}  # request id → its unsent chunk
        self._wake = asyncio.Event()
        self.closed = False

    # -- commands ---------------------------------------------------------------------------------

    def command(self, command: compute_pb2.NodeCommand) -> None:
        kind = command.WhichOneof("command")
        if kind == "start":
            self.start(command.start)
        elif kind == "cancel":
            self.cancel(command.cancel)
        else:
            log.warning("ignoring an empty command on a Serve stream")

    def start(self, request: compute_pb2.ComputeRequest) -> None:
        if request.request_id in self.requests:
            self.emit(error_event(request.request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                  f"request {request.request_id!r} is already running on this stream"))
            return
        stream = RequestStream(request, self.node, self.emit, self._ended)
        self.requests[request.request_id] = stream
        self.node.request_started()
        task = asyncio.create_task(stream.run(), name=f"start-{request.request_id}")
        self._starting.add(task)
        task.add_done_callback(self._started)

    def cancel(self, request_id: str) -> None:
        stream = self.requests.get(request_id)
        if stream is not None:
            stream.cancel()

    def _started(self, task: asyncio.Task) -> None:
        self._starting.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("starting a request failed", exc_info=task.exception())

    def _ended(self, stream: RequestStream) -> None:
        if self.requests.get(stream.request_id) is stream:
            del self.requests[stream.request_id]
            self.node.request_ended()

    # -- events -----------------------------------------------------------------------------------

    def emit(self, event: compute_pb2.RequestEvent) -> None:
        """Queue ``event`` for the router, merged into that request's unsent chunk if it has one."""
        if self.closed:
            return
        if event.HasField("chunk"):
            pending = self._open_chunk.get(event.request_id)
            if pending is not None:
                pending.token_ids.extend(event.chunk.token_ids)
                pending.text += event.chunk.text
                pending.finish_reason = event.chunk.finish_reason
                if event.chunk.HasField("usage"):
                    pending.usage.CopyFrom(event.chunk.usage)
                return
            self._events.append(event)
            self._open_chunk[event.request_id] = event.chunk
        else:
            self._events.append(event)
            self._open_chunk.pop(event.request_id, None)
        self._wake.set()

    async def next_events(self) -> compute_pb2.NodeEvents | None:
        """The events queued since the last call (waits for some); None once the session closed."""
        while not self._events:
            if self.closed:
                return None
            await self._wake.wait()
            self._wake.clear()
        events = compute_pb2.NodeEvents(events=self._events)
        self._events = []
        self._open_chunk.clear()
        return events

    def close(self) -> None:
        """The stream is over: abort every request still running (their blocks are freed)."""
        if self.closed:
            return
        self.closed = True
        for task in list(self._starting):
            task.cancel()
        for stream in list(self.requests.values()):
            stream.cancel()
        self._wake.set()
