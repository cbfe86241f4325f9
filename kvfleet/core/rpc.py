"""Every gRPC server and channel of the fleet is made here: one keepalive policy on both ends
(``kvfleet.core.keepalive``), and undecodable requests answered as the caller's mistake. Every server
serves gRPC health and reflection the same way (``serve_health_and_reflection``).

gRPC's own path for a request whose bytes are not the method's message lets the protobuf
``DecodeError`` escape from the request deserializer: the caller gets UNKNOWN and the server logs
a seven-line traceback per message, so anyone who can reach a port can flood the log. ``server()``
installs ``DecodeGuard``, which wraps each method's deserializer to hand an ``Undecodable`` marker
to a thin wrapper around the method, and that wrapper answers INVALID_ARGUMENT in one line (logged
at DEBUG only). Streamed requests are checked as the servicer iterates over them, so a stream
handler must read its requests through the request iterator, not ``context.read()``.

Internal servers (``server(internal=True)``, bound with ``bind_internal``) and the channels to
them (``channel(target, peer=IDENTITY)``) speak mutual TLS with this process's credentials
(``kvfleet.core.tls``) and check every call's caller against ``kvfleet.core.access`` (``AccessGuard``); the
public doors (the router's) are plain servers and channels without a peer.

Servers and channels are created through ``grpc.aio.*`` at call time, after ``setup_tracing``
may have instrumented them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvfleet.core import tls
from kvfleet.core.access_guard import AccessGuard
from kvfleet.core.identity import Identity
from kvfleet.core.keepalive import KeepalivePolicy
from kvfleet.core.keepalive import server_options as keepalive_server_options
from kvfleet.core.rpc_handlers import rewrap

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


def keepalive_policy() -> KeepalivePolicy:
    """This process's client policy: the default, or ``KVFLEET_KEEPALIVE_MS`` when it is valid."""
    try:
        return KeepalivePolicy.from_env(os.environ)
    except ValueError as e:
        log.warning("%s; using the default keepalive", e)
        return KeepalivePolicy()


def channel_options(max_receive_bytes: int | None = None,
                    keepalive: KeepalivePolicy | None = None) -> list[tuple[str, int]]:
    options = (keepalive or keepalive_policy()).channel_options()
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return options


def _secure_options(options: list, peer: Identity | None, credentials: tls.Credentials | None = None,
                    public_ca: bytes | None = None) -> tuple[grpc.ChannelCredentials | None, list]:
    """``credentials`` (else this process's) when ``peer`` (an internal service) is called under
    mutual TLS, with the options that make the handshake insist on ``peer``'s certificate; for a
    public door (no ``peer``) served over TLS, server TLS trusting ``public_ca``."""
    if peer is None:
        return (grpc.ssl_channel_credentials(root_certificates=public_ca) if public_ca else None), options
    credentials = credentials or tls.current()
    if credentials is None:
        return None, options
    return credentials.channel_credentials(), [*options, ("grpc.ssl_target_name_override", peer.host_name)]


def channel(target: str, max_receive_bytes: int | None = None, peer: Identity | None = None,
            credentials: tls.Credentials | None = None, public_ca: bytes | None = None,
            keepalive: KeepalivePolicy | None = None) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` that pings by the fleet's keepalive policy. ``peer``: the
    internal service expected there, reached over mutual TLS when this process has credentials
    (``kvfleet.core.tls``, or ``credentials``: a test's admin); None: a public door, in plaintext, or
    over TLS trusting ``public_ca`` (PEM: the CA of the router's ``--tls-cert``). ``keepalive``: another
    policy than this process's (the router's node links)."""
    credentials, options = _secure_options(channel_options(max_receive_bytes, keepalive), peer, credentials,
                                           public_ca)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


def sync_channel(target: str, peer: Identity | None = None, credentials: tls.Credentials | None = None,
                 public_ca: bytes | None = None) -> grpc.Channel:
    """The same for a synchronous client (the command line's ``generate``)."""
    credentials, options = _secure_options(channel_options(), peer, credentials, public_ca)
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


# gRPC binds its servers' ports with SO_REUSEPORT unless told not to: a second server on a port already
# bound (a port picked twice, a service started twice) then binds too, and the kernel splits new
# connections between the two, so a TLS client may reach a plaintext one (seen as WRONG_VERSION_NUMBER
# in tests on several workers). Off, the second bind fails and says so.
NO_REUSEPORT = ("grpc.so_reuseport", 0)


def server_options(max_send_bytes: int | None = None) -> list[tuple[str, int]]:
    options = [*keepalive_server_options(), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES), NO_REUSEPORT]
    if max_send_bytes is not None:
        options.append(("grpc.max_send_message_length", max_send_bytes))
    return options


def server(max_send_bytes: int | None = None, interceptors: Sequence = (), internal: bool = False) -> grpc.aio.Server:
    """An asyncio server that accepts the fleet's keepalive pings, takes requests up to
    ``MAX_MESSAGE_BYTES`` and answers undecodable ones INVALID_ARGUMENT; not bound, not started.
    ``internal``: every call is checked against ``kvfleet.core.access.RULES`` by its caller's identity
    (under mutual TLS; bind it with ``bind_internal``). ``interceptors`` (a metrics counter, say)
    run after the guards."""
    # tracing's instrumentation, when installed, puts its interceptor ahead of this one
    guards = [DecodeGuard(), AccessGuard(enforce=tls.current() is not None)] if internal else [DecodeGuard()]
    return grpc.aio.server(interceptors=[*guards, *interceptors], options=server_options(max_send_bytes))


def bind_internal(server: grpc.aio.Server, address: str) -> int:
    """Listen on ``address`` under mutual TLS when this process has credentials, else in
    plaintext; the port bound (0: could not bind)."""
    credentials = tls.current()
    return add_port(server, address, None if credentials is None else credentials.server_credentials())


def add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Listen on ``address`` (under ``credentials`` when given, else in plaintext); the port bound,
    0 when it cannot be bound (in use, say: ``NO_REUSEPORT``). gRPC raises there rather than
    answer 0 as it once did."""
    try:
        return server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    except RuntimeError:
        return 0


def serve_health_and_reflection(server: grpc.aio.Server, service_name: str):
    """Add the gRPC health service and server reflection to ``server``; the health servicer, for
    the caller to set ``service_name`` SERVING when it is (``""``, the process, answers SERVING at
    once: liveness). Reflection lists ``service_name``, health and itself, so ``grpcurl`` and
    ``grpc_cli`` can call any kvfleet server without the .proto files."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([service_name, health_name, reflection.SERVICE_NAME], server)
    return health_servicer


@dataclass(slots=True, frozen=True)
class Undecodable:
    """What a guarded deserializer returns instead of raising; ``message`` is the caller's answer."""

    message: str


def _guarded_deserializer(deserializer):
    if deserializer is None:  # the method takes raw bytes: nothing to decode
        return None
    message_type = getattr(deserializer, "__self__", None)
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    what = f"a {descriptor.full_name} message" if descriptor is not None else "the method's request message"

    def deserialize(raw: bytes):
        try:
            return deserializer(raw)
        except Exception:  # DecodeError, or whatever a hand-written deserializer raises
            return Undecodable(f"the request is not {what} ({len(raw)} bytes that do not decode)")

    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, request: Undecodable) -> None:
    log.debug("undecodable request from %s: %s", context.peer(), request.message)
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


async def _checked_stream(requests, context):
    async for request in requests:
        if isinstance(request, Undecodable):
            await _refuse(context, request)
        yield request


async def _checked(request, context, streaming: bool):
    """The request (or request iterator) the method gets; aborts on an undecodable one."""
    if streaming:
        return _checked_stream(request, context)
    if isinstance(request, Undecodable):
        await _refuse(context, request)
    return request


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    if handler.request_deserializer is None:
        return handler
    streaming = handler.request_streaming
    return rewrap(handler, lambda request, context: _checked(request, context, streaming),
                  _guarded_deserializer(handler.request_deserializer))


class DecodeGuard(grpc.aio.ServerInterceptor):
    """Hands every method a guarded deserializer and behavior (made once per method)."""

    def __init__(self) -> None:
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is None:
            handler = await continuation(handler_call_details)
            if handler is None:  # no such method: gRPC answers UNIMPLEMENTED
                return None
            guarded = self._guarded[method] = _guard(handler)
        return guarded
