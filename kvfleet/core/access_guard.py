"""The internal servers' access check (``kvfleet.core.rpc.server(internal=True)``): every call's caller,
as its client certificate names it (``kvfleet.core.identity``), against ``kvfleet.core.access.RULES``.

A refusal is PERMISSION_DENIED with the reason, and one WARNING line naming the identity, the
method and the peer address, at most one a second per (identity, method) so a caller in a loop
cannot flood the log. The caller of the call in progress is ``caller()`` (a context variable),
for the checks that need the servicer's state (whose sequences a node names). Without mutual TLS
(``--insecure-internal``) nothing is checked and ``caller()`` is None.
"""

from __future__ import annotations

import contextvars
import logging
import time

import grpc

from kvfleet.core import access
from kvfleet.core.identity import Identity
from kvfleet.core.rpc_handlers import rewrap

log = logging.getLogger(__name__)

_caller: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("kvfleet_caller", default=None)
_LOG_EVERY_S = 1.0


def caller() -> Identity | None:
    """The identity calling the internal method in progress (None: plaintext, nothing checked)."""
    return _caller.get()


def identity_of(context: grpc.aio.ServicerContext) -> Identity | None:
    """The identity the peer's verified certificate names; None without one (or not a kvfleet one)."""
    names = context.auth_context().get("x509_common_name") or []
    try:
        return Identity.parse(names[0].decode()) if names else None
    except (ValueError, UnicodeDecodeError):
        return None


class AccessGuard(grpc.aio.ServerInterceptor):
    def __init__(self, enforce: bool = True) -> None:
        self.enforce = enforce
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}
        self._last_logged: dict[tuple[str, str], float] = {}

    def _log_refusal(self, who: str, method: str, peer: str, why: str) -> None:
        now = time.monotonic()
        if now - self._last_logged.get((who, method), -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_logged[(who, method)] = now
            log.warning("PERMISSION_DENIED %s calling %s from %s: %s", who, method, peer, why)

    def _check(self, method: str, streaming: bool):
        async def check(request, context):
            identity = identity_of(context)
            if identity is None:
                why = "no kvfleet identity in the client certificate"
            else:
                why = access.refusal(method, identity, None if streaming else request)
            if why is not None:
                self._log_refusal(str(identity or "anonymous"), method, context.peer(), why)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)
            _caller.set(identity)
            return request
        return check

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if not self.enforce or handler is None:
            return handler
        method = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is None:
            guarded = self._guarded[method] = rewrap(handler, self._check(method, handler.request_streaming))
        return guarded
