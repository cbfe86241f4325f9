"""The router's gRPC surface: ``kvfleet.v1.Inference`` plus health and reflection.

The servicer is glue: authenticate from the call's metadata, then the one path every door shares
(``kvfleet.router.generation``: check and tokenize, claim the request id, wait for a turn, relay). Every
refusal carries its status (``kvfleet.router.generation.status_name``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2
from opentelemetry import trace

from kvfleet.core import rpc
from kvfleet.core.identity import Identity
from kvfleet.router.generation import REFUSALS, Generations, status_name
from kvfleet.router.node_stream import NodeStream
from kvfleet.router.nodes import NodeTable
from kvfleet.router.relay import RelayError
from kvfleet.v1 import compute_pb2_grpc, inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


def dial_compute(address: str, node_id: str) -> tuple[grpc.aio.Channel, NodeStream]:
    """A channel and Serve stream for node ``node_id`` (``NodeTable``'s ``dial``); the stream opens
    on first use. Under mutual TLS the handshake insists on that node's certificate, so an address
    in etcd that another process answers is refused. Keepalive pings, every second
    (``KeepalivePolicy.node_link``), find a node whose host vanished without closing its sockets, or
    that this router can no longer reach, within ~2.5 s: the stream breaks and its requests resume
    on another node."""
    channel = rpc.channel(address, max_receive_bytes=rpc.MAX_MESSAGE_BYTES, peer=Identity.node(node_id),
                          keepalive=rpc.keepalive_policy().node_link())
    return channel, NodeStream(compute_pb2_grpc.ComputeStub(channel), address)

class CannotListen(RuntimeError):
    """An address to serve on is taken or malformed: the router says so in one line and exits."""


SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, generations: Generations):
        self.generations = generations

    async def Generate(self, request, context):
        try:
            tenant = self.generations.tenants.authenticate_metadata(context.invocation_metadata() or ())
            async with self.generations.generation(tenant, request) as chunks:
                async for chunk in chunks:
                    yield chunk
        except (*REFUSALS, RelayError) as e:
            await context.abort(grpc.StatusCode[status_name(e)], str(e))


@dataclass(slots=True)
class RouterServer:
    server: grpc.aio.Server
    port: int
    nodes: NodeTable
    health: health.aio.HealthServicer

    async def update_health(self) -> None:
        """``kvfleet.v1.Inference`` is SERVING while a node is READY (readiness); the server as a
        whole (service ``""``) stays SERVING while the process answers (liveness: a router with no
        node to route to is not broken, and restarting it would not bring nodes back)."""
        status = health_pb2.HealthCheckResponse.SERVING if self.nodes.ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(SERVICE_NAME, status)


async def build_server(
    listen: str,
    generations: Generations,
    nodes: NodeTable,
    unix_socket: str | None = None,
    tls: grpc.ServerCredentials | None = None,
) -> RouterServer:
    """Bind the router's services on ``listen`` (``host:port``; port 0 picks one; over TLS with
    ``tls``) and, when given, on the Unix domain socket ``unix_socket`` too (plaintext: only this
    machine reaches it, through the file's permissions); not started."""
    server = rpc.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(generations), server)
    health_servicer = rpc.serve_health_and_reflection(server, SERVICE_NAME)
    port = rpc.add_port(server, listen, tls)
    if port == 0:
        raise CannotListen(f"cannot listen on {listen}")
    if unix_socket is not None and rpc.add_port(server, f"unix:{unix_socket}") == 0:
        raise CannotListen(f"cannot listen on the Unix socket {unix_socket}")
    routed = RouterServer(server, port, nodes, health_servicer)
    await routed.update_health()
    return routed
