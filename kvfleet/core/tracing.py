"""OpenTelemetry for every kvfleet process: one trace per request, router → compute → block_service.

``setup_tracing(service)`` installs an SDK tracer provider named after the service and instruments
``grpc.aio`` globally (opentelemetry-instrumentation-grpc's aio server and client instrumentors
patch ``grpc.aio.server`` / ``grpc.aio.insecure_channel``), so every server and channel created
afterwards opens a span per RPC and carries the W3C ``traceparent`` in metadata. Create servers and
channels after this call, through ``grpc.aio.*`` attribute access (not ``from grpc.aio import``).

Spans are exported over OTLP/gRPC only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the traces-specific
variable) is set; otherwise no tracer provider is installed: gRPC is not instrumented (no
per-message cost) and the spans the services open themselves are the API's no-op spans. etcd's own RPCs,
health checks and reflection are not traced: they are noise around the requests. Nor is the
router↔node ``Compute/Serve`` stream: it outlives requests, so each request's node-side spans take
their parent from the trace context in its start command instead.

A node's write-behind bookkeeping (``ApplyMany``: the commits, top-ups and releases of every
request that ran a step) belongs to no one request: ``batch_span`` opens its own trace for it,
linked to the span of each request it carries (``BatchLinks``), so a request's trace leads to the
block_service calls made for it and each call to the requests it served.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

log = logging.getLogger(__name__)

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# The router↔node Serve stream lives as long as both do and carries many requests: their spans
# are opened by hand from the trace context each request's start command carries.
_UNTRACED_SERVICES = ("etcdserverpb.", "grpc.health.", "grpc.reflection.", "kvfleet.v1.Compute/Serve")

_provider: TracerProvider | None = None


def otlp_endpoint() -> str | None:
    for var in _ENDPOINT_VARS:
        if os.environ.get(var):
            return os.environ[var]
    return None


def _traced(details) -> bool:
    """Instrumentation filter: False for the RPCs that are not worth a span."""
    method = getattr(details, "method", "") or ""
    if isinstance(method, bytes):
        method = method.decode()
    return not method.lstrip("/").startswith(_UNTRACED_SERVICES)


def setup_tracing(service_name: str) -> TracerProvider | None:
    """Install tracing for this process (idempotent). With no OTLP endpoint set, nothing is
    installed: the API's no-op tracer makes every span the services open cost next to nothing."""
    global _provider
    if _provider is not None:
        return _provider
    endpoint = otlp_endpoint()
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.grpc import (  # patches grpc on import use
        GrpcAioInstrumentorClient,
        GrpcAioInstrumentorServer,
    )

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    # The exporter reads the endpoint, headers and insecure flag from the standard variables.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    log.info("tracing %s: exporting spans over OTLP to %s", service_name, endpoint)
    trace.set_tracer_provider(provider)
    GrpcAioInstrumentorServer(filter_=_traced).instrument(tracer_provider=provider)
    GrpcAioInstrumentorClient(filter_=_traced).instrument(tracer_provider=provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush spans still buffered (call before the process exits)."""
    if _provider is not None:
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


class BatchLinks:
    """The trace of each sequence a batched call works for, as span links (any thread).

    ``context_of`` answers a live request's trace context; a request that ended may have gone
    from it by the time its release is sent (write-behind), so ``hold`` keeps the context of a
    sequence whose release is queued until ``take`` sends it. At most ``max_held`` are kept: a
    release that is never sent (a sync made it moot) costs a link, not memory.
    """

    def __init__(self, context_of: Callable[[str], object], max_held: int = 4096):
        self.context_of = context_of
        self.max_held = max_held
        self._held: dict[str, object] = {}
        self._lock = threading.Lock()

    def hold(self, seq_ids: Iterable[str]) -> None:
        with self._lock:
            for seq_id in seq_ids:
                context = self.context_of(seq_id)
                if context is not None:
                    self._held[seq_id] = context
            while len(self._held) > self.max_held:
                self._held.pop(next(iter(self._held)))

    def take(self, seq_ids: Iterable[str]) -> list[trace.Link]:
        """One link per distinct request span among these sequences' (held ones given up)."""
        links: dict[tuple[int, int], trace.Link] = {}
        for seq_id in dict.fromkeys(seq_ids):
            with self._lock:
                context = self._held.pop(seq_id, None)
            if context is None:
                context = self.context_of(seq_id)
            span = trace.get_current_span(context).get_span_context() if context is not None else None
            if span is not None and span.is_valid:
                links.setdefault((span.trace_id, span.span_id), trace.Link(span))
        return list(links.values())


def batch_span(name: str, links: list[trace.Link], attributes: dict):
    """Open ``name`` as the current span, the root of a trace of its own (whatever trace the caller
    is in: a batch is not that request's work), linked to the requests it serves."""
    return tracer("kvfleet.batch").start_as_current_span(name, context=otel_context.Context(), links=links,
                                                          attributes=attributes)
