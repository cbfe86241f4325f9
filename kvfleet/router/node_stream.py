"""The router's one ``Compute.Serve`` stream to a node, shared by every request it sends there.

    start(request)  → a start command on the stream (commands queued while a write is in flight go
                      together in the next message); returns the request's inbox
    reader task     : NodeEvents from the node → each RequestEvent into its request's inbox
    finish(id)      → the request is over for the router (a cancel command if the node still runs it)
    stream breaks   → a NodeFailure in every open inbox; the next start opens a fresh stream

One stream per node instead of one call per request: the node sends one message per engine step
for all of this router's requests, and the router reads one, so per-token gRPC work does not grow
with the batch.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvfleet.v1 import compute_pb2

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class NodeFailure(Exception):
    """A request ended on the node without finishing: the node's error answer for it, or the
    stream to the node broke. ``refusal`` is block_service's reason for RESOURCE_EXHAUSTED."""

    def __init__(self, code: grpc.StatusCode, details: str, refusal: str = ""):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.refusal = refusal

    @classmethod
    def from_event(cls, error: compute_pb2.RequestError) -> "NodeFailure":
        return cls(_CODES.get(error.code, grpc.StatusCode.UNKNOWN), error.message, error.refusal)


Inbox = asyncio.Queue  # of compute_pb2.RequestEvent, or a NodeFailure when the stream broke


class _Link:
    """One open Serve call and the requests started on it."""

    def __init__(self, stub, node_id: str):
        self.node_id = node_id
        self.call = stub.Serve()
        self.inboxes: dict[str, Inbox] = {}
        self.commands: asyncio.Queue[compute_pb2.NodeCommand] = asyncio.Queue()
        self.broken = False
        self.writer = asyncio.create_task(self._write(), name=f"serve-write-{node_id}")
        self.reader = asyncio.create_task(self._read(), name=f"serve-read-{node_id}")

    async def _write(self) -> None:
        try:
            while True:
                batch = [await self.commands.get()]
                while not self.commands.empty():  # what queued up meanwhile goes in the same message
                    batch.append(self.commands.get_nowait())
                await self.call.write(compute_pb2.NodeCommands(commands=batch))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the call is over; the reader reports how it ended
            log.debug("Serve stream to %s: write failed: %r", self.node_id, e)

    async def _read(self) -> None:
        failure = NodeFailure(grpc.StatusCode.CANCELLED, "the router closed the stream")
        try:
            while True:
                message = await self.call.read()
                if message is grpc.aio.EOF:
                    failure = NodeFailure(grpc.StatusCode.UNAVAILABLE, f"node {self.node_id} ended the stream")
                    break
                for event in message.events:
                    inbox = self.inboxes.get(event.request_id)
                    if inbox is not None:  # else: a request the router already gave up on
                        inbox.put_nowait(event)
        except grpc.aio.AioRpcError as e:
            failure = NodeFailure(e.code(), e.details() or e.code().name)
        finally:
            self.fail_all(failure)

    def fail_all(self, failure: NodeFailure) -> None:
        if self.broken:
            return
        self.broken = True
        if self.inboxes:
            log.warning("Serve stream to node %s broke with %d requests on it: %s", self.node_id,
                        len(self.inboxes), failure)
        for inbox in self.inboxes.values():
            inbox.put_nowait(failure)
        self.inboxes.clear()
        self.writer.cancel()
        self.call.cancel()


class NodeStream:
    def __init__(self, stub, node_id: str):
        self.stub = stub
        self.node_id = node_id
        self._link: _Link | None = None

    def start(self, request: compute_pb2.ComputeRequest) -> Inbox:
        """Start ``request`` (its ``request_id`` unique on this stream); its events arrive in the inbox."""
        link = self._link
        inbox: Inbox = asyncio.Queue()
        if link is None or link.broken:
            try:
                link = self._link = _Link(self.stub, self.node_id)
            except grpc.aio.UsageError as e:  # its channel closed: the node left etcd since it was picked
                inbox.put_nowait(NodeFailure(grpc.StatusCode.UNAVAILABLE, f"node {self.node_id}: {e}"))
                return inbox  # a node failure: the relay tries another node
        link.inboxes[request.request_id] = inbox
        link.commands.put_nowait(compute_pb2.NodeCommand(start=request))
        return inbox

    def finish(self, request_id: str, cancel: bool) -> None:
        """Stop routing ``request_id``'s events; with ``cancel``, tell the node to abort it."""
        link = self._link
        if link is not None and link.inboxes.pop(request_id, None) is not None and cancel and not link.broken:
            link.commands.put_nowait(compute_pb2.NodeCommand(cancel=request_id))

    async def close(self) -> None:
        link, self._link = self._link, None
        if link is not None:
            link.fail_all(NodeFailure(grpc.StatusCode.UNAVAILABLE, f"node {self.node_id} left"))
            link.reader.cancel()
            await asyncio.gather(link.reader, link.writer, return_exceptions=True)
