"""Putting a check in front of a gRPC method's handler (``kvfleet.core.rpc.DecodeGuard``,
``kvfleet.core.access_guard.AccessGuard``): the same kind of handler, its behavior run after the check.

gRPC tells a response-streaming handler (an async generator) from a unary one (a coroutine) by
inspection, so the wrapper is made of the same kind.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable

import grpc

Check = Callable[[object, grpc.aio.ServicerContext], Awaitable[object]]

_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def after_check(behavior, check: Check):
    """``behavior`` run on what ``await check(request, context)`` returns (it aborts to refuse);
    None for a synchronous behavior (the fleet has none)."""
    if inspect.isasyncgenfunction(behavior):
        async def checked(request, context):
            request = await check(request, context)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
    elif inspect.iscoroutinefunction(behavior):
        async def checked(request, context):
            return await behavior(await check(request, context), context)
    else:
        return None
    return checked


def rewrap(handler: grpc.RpcMethodHandler, check: Check, deserializer=None) -> grpc.RpcMethodHandler:
    """``handler`` with ``check`` in front (and ``deserializer`` in place of its own, when given)."""
    attribute, make = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior = after_check(getattr(handler, attribute), check)
    if behavior is None:
        return handler
    return make(behavior, request_deserializer=deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)
