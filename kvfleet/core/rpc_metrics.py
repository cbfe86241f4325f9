"""A gRPC server interceptor that counts calls by method: a service's operations by kind, for
Prometheus, at the cost of one labelled counter increment per call (the handler is untouched)."""

from __future__ import annotations

from collections.abc import Collection

import grpc


class CallCounter(grpc.aio.ServerInterceptor):
    """``counter`` (a prometheus_client ``Counter`` with one label) += 1 per call, labelled with the
    method's name (``/pkg.Service/Method`` → ``Method``). Names outside ``methods`` count as
    ``other``: anyone can call any path, and a label must stay bounded."""

    def __init__(self, counter, methods: Collection[str]) -> None:
        self.counter = counter
        self.methods = frozenset(methods)

    async def intercept_service(self, continuation, handler_call_details):
        name = handler_call_details.method.rsplit("/", 1)[-1]
        self.counter.labels(name if name in self.methods else "other").inc()
        return await continuation(handler_call_details)
