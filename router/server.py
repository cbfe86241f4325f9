"""The router's gRPC surface: ``kvfleet.v1.Inference`` plus health and reflection.

The servicer is glue: authenticate (``TenantDirectory``), check and tokenize (``parse_request``),
refuse a request id already running (``RunningIds``), wait for a turn (``Admission``), relay
(``Relay``). Every refusal is mapped to its status in ``_STATUS``, in one place.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import trace

from kvfleet import rpc
from kvfleet.tenants import Tenant
from kvfleet.v1 import compute_pb2_grpc, inference_pb2, inference_pb2_grpc
from router.admission import Admission, Shed
from router.node_stream import NodeStream
from router.nodes import NodeTable
from router.relay import Relay, RelayError
from router.request import InvalidRequest, ModelVocabulary, ParsedRequest, parse_request
from router.running_ids import AlreadyRunning, RunningIds
from router.tenants import AuthError, TenantDirectory

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


def dial_compute(address: str) -> tuple[grpc.aio.Channel, NodeStream]:
    """A channel and Serve stream for a node (``NodeTable``'s ``dial``); the stream opens on first
    use. Keepalive pings find a node whose host vanished without closing its sockets."""
    channel = rpc.channel(address, max_receive_bytes=rpc.MAX_MESSAGE_BYTES)
    return channel, NodeStream(compute_pb2_grpc.ComputeStub(channel), address)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name


class NoTokenizer(Exception):
    """No model directory to read ``tokenizer.json`` from yet."""


_STATUS: dict[type[Exception], grpc.StatusCode] = {
    AuthError: grpc.StatusCode.UNAUTHENTICATED,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    Shed: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AlreadyRunning: grpc.StatusCode.ALREADY_EXISTS,
    NoTokenizer: grpc.StatusCode.UNAVAILABLE,
}


class TokenizerSource:
    """The model's tokenizer and vocabulary size (``ModelVocabulary``), from ``--model`` or else the
    model directory a READY node advertises (the router runs next to the nodes, or mounts the same
    model volume)."""

    def __init__(self, nodes: NodeTable, model_dir: str | None = None):
        self.nodes = nodes
        self.model_dir = model_dir
        self._tokenizer = None
        self._lock = asyncio.Lock()

    async def get(self):
        if self._tokenizer is not None:
            return self._tokenizer
        async with self._lock:
            if self._tokenizer is None:
                model_dir = self.model_dir or next((n.info.model for n in self.nodes.ready()), None)
                if model_dir is None:
                    raise NoTokenizer("no READY compute node yet (its model directory gives the tokenizer)")
                self._tokenizer = await asyncio.to_thread(_model_vocabulary, model_dir)
        return self._tokenizer


def _model_vocabulary(model_dir: str) -> ModelVocabulary:
    from compute_service.model_config import ModelConfig
    from compute_service.tokenizer import Tokenizer  # tokenizers is slow to import

    return ModelVocabulary(Tokenizer(model_dir), ModelConfig.from_dir(model_dir).vocab_size)


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, tenants: TenantDirectory, admission: Admission, relay: Relay, tokenizers: TokenizerSource):
        self.tenants = tenants
        self.admission = admission
        self.relay = relay
        self.tokenizers = tokenizers
        self.running = RunningIds()

    async def Generate(self, request, context):
        try:
            tenant, parsed = await self._admit(request, context)
        except tuple(_STATUS) as e:
            await context.abort(_STATUS[type(e)], str(e))
        try:
            async for chunk in self.relay.run(parsed, tenant):
                yield chunk
        except RelayError as e:
            await context.abort(e.code, str(e))
        finally:
            self.admission.finish(tenant.name)
            self.running.release(tenant.name, parsed.request_id)

    async def _admit(self, request, context) -> tuple[Tenant, ParsedRequest]:
        """Who calls and what, its request id marked running, and its turn; the caller must
        ``admission.finish`` and ``running.release`` once the request is over."""
        span = trace.get_current_span()
        tenant = self.tenants.authenticate_metadata(context.invocation_metadata() or ())
        span.set_attribute("kvfleet.tenant", tenant.name)
        parsed = parse_request(request, await self.tokenizers.get())
        span.set_attribute("kvfleet.request_id", parsed.request_id)
        self.running.claim(tenant.name, parsed.request_id)
        try:
            with tracer.start_as_current_span("queue", attributes={"kvfleet.tenant": tenant.name}):
                await self.admission.wait(parsed.seq_id, tenant.name, self.tenants.normalised_paid_level(tenant))
        except BaseException:  # shed, or the caller left while it waited
            self.running.release(tenant.name, parsed.request_id)
            raise
        return tenant, parsed


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
    tenants: TenantDirectory,
    admission: Admission,
    relay: Relay,
    nodes: NodeTable,
    tokenizers: TokenizerSource,
    unix_socket: str | None = None,
) -> RouterServer:
    """Bind the router's services on ``listen`` (``host:port``; port 0 picks one) and, when given,
    on the Unix domain socket ``unix_socket`` too; not started."""
    server = rpc.server()
    inference_pb2_grpc.add_InferenceServicer_to_server(
        InferenceServicer(tenants, admission, relay, tokenizers), server
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"cannot listen on {listen}")
    if unix_socket is not None and server.add_insecure_port(f"unix:{unix_socket}") == 0:
        raise RuntimeError(f"cannot listen on the Unix socket {unix_socket}")
    routed = RouterServer(server, port, nodes, health_servicer)
    await routed.update_health()
    return routed
