"""Every gRPC server and channel of the fleet is made here: one keepalive policy on both ends
(``kvfleet.keepalive``), and undecodable requests answered as the caller's mistake. Every server
serves gRPC health and reflection the same way (``serve_health_and_reflection``).

gRPC's own path for a request whose bytes are not the method's message lets the protobuf
``DecodeError`` escape from the request deserializer: the caller gets UNKNOWN and the server logs
a seven-line traceback per message, so anyone who can reach a port can flood the log. ``server()``
installs ``DecodeGuard``, which wraps each method's deserializer to hand an ``Undecodable`` marker
to a thin wrapper around the method, and that wrapper answers INVALID_ARGUMENT in one line (logged
at DEBUG only). Streamed requests are checked as the servicer iterates over them, so a stream
handler must read its requests through the request iterator, not ``context.read()``.

Servers and channels are created through ``grpc.aio.*`` at call time, after ``setup_tracing``
may have instrumented them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from kvfleet.keepalive import KeepalivePolicy
from kvfleet.keepalive import server_options as keepalive_server_options

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20


def keepalive_policy() -> KeepalivePolicy:
    """This process's client policy: the default, or ``KVFLEET_KEEPALIVE_MS`` when it is valid."""
    try:
        return KeepalivePolicy.from_env(os.environ)
    except ValueError as e:
        log.warning("%s; using the default keepalive", e)
        return KeepalivePolicy()


def channel_options(max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    options = keepalive_policy().channel_options()
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    return options


def channel(target: str, max_receive_bytes: int | None = None) -> grpc.aio.Channel:
    """An insecure asyncio channel to ``target`` that pings by the fleet's keepalive policy."""
    return grpc.aio.insecure_channel(target, options=channel_options(max_receive_bytes))


def sync_channel(target: str) -> grpc.Channel:
    """The same for a synchronous client (the command line's ``generate``)."""
    return grpc.insecure_channel(target, options=channel_options())


def server_options(max_send_bytes: int | None = None) -> list[tuple[str, int]]:
    options = [*keepalive_server_options(), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if max_send_bytes is not None:
        options.append(("grpc.max_send_message_length", max_send_bytes))
    return options


def server(max_send_bytes: int | None = None, interceptors: Sequence = ()) -> grpc.aio.Server:
    """An asyncio server that accepts the fleet's keepalive pings, takes requests up to
    ``MAX_MESSAGE_BYTES`` and answers undecodable ones INVALID_ARGUMENT; not bound, not started.
    ``interceptors`` (a metrics counter, say) run after the decode guard."""
    # tracing's instrumentation, when installed, puts its interceptor ahead of this one
    return grpc.aio.server(interceptors=[DecodeGuard(), *interceptors], options=server_options(max_send_bytes))


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


def _guarded_behavior(behavior, streaming: bool):
    """``behavior`` behind the check, of the same kind (gRPC tells a response-streaming async
    generator from a coroutine by inspection); None for a synchronous one (the fleet has none)."""
    if inspect.isasyncgenfunction(behavior):
        async def guarded(request, context):
            request = await _checked(request, context, streaming)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
    elif inspect.iscoroutinefunction(behavior):
        async def guarded(request, context):
            return await behavior(await _checked(request, context, streaming), context)
    else:
        return None
    return guarded


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kinds = {
        (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
        (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
        (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
        (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
    }
    attribute, make = kinds[(handler.request_streaming, handler.response_streaming)]
    behavior = _guarded_behavior(getattr(handler, attribute), handler.request_streaming)
    if behavior is None or handler.request_deserializer is None:
        return handler
    return make(behavior, request_deserializer=_guarded_deserializer(handler.request_deserializer),
                response_serializer=handler.response_serializer)


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
