"""Prometheus text for a service whose state lives on an asyncio event loop.

    scrape (HTTP thread) ──call_soon_threadsafe──▶ read() on the loop ──▶ a plain sample ──▶ families

``prometheus_client``'s HTTP server answers in its own thread, so the event loop never waits for a
scrape. The services' counters, though, belong to the loop (nothing else may touch the page table,
the queue or the node table), so a collector never reads them from the HTTP thread: it asks the loop
to build a sample (a few dataclasses, copied) and maps that sample to metric families in the HTTP
thread. A loop too busy to answer within ``timeout_s`` costs that scrape its figures, never the loop
its time. Histograms are the exception: they are observed where the event happens (cheap, and
``prometheus_client``'s metrics are thread-safe).

Each service builds its own ``CollectorRegistry`` (no process-global state: tests run several in one
process), registers its ``LoopCollector`` there, and calls ``serve_metrics``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvfleet.core.settings import setting

log = logging.getLogger(__name__)

T = TypeVar("T")

# from 1 ms (a CPU token of a tiny model, a GPU decode step) to 60 s (a long CPU prefill, a queued request)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 30.0, 45.0, 60.0)
# an fsync: tens of microseconds on a battery-backed disk, up to a second on a struggling one
FSYNC_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def read_on_loop(loop: asyncio.AbstractEventLoop, read: Callable[[], Awaitable[T]], timeout_s: float = 5.0) -> T:
    """``await read()`` run on ``loop``, from any other thread; raises ``TimeoutError`` when the loop
    does not finish it in time (the read is then cancelled)."""
    future = asyncio.run_coroutine_threadsafe(read(), loop)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise TimeoutError(f"the event loop did not answer a scrape within {timeout_s:g}s") from None


class LoopCollector(Collector, Generic[T]):
    """A collector whose figures are sampled on the service's loop at scrape time.

    ``read`` (a coroutine function) runs on the loop and returns a plain sample; ``families`` (pure) maps it to metric
    families in the scraping thread. A failed read yields no families (and one log line), so the
    scrape still returns the histograms and whatever other collectors have.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, read: Callable[[], Awaitable[T]],
                 families: Callable[[T], Iterable[Metric]], timeout_s: float = 5.0):
        self.loop = loop
        self.read = read
        self.families = families
        self.timeout_s = timeout_s

    def collect(self) -> Iterable[Metric]:
        try:
            sample = read_on_loop(self.loop, self.read, self.timeout_s)
        except Exception as e:
            log.warning("metrics: %s: %s", type(e).__name__, e)
            return []
        return list(self.families(sample))

    def describe(self) -> Iterable[Metric]:
        return []  # no sample at registration time: the registry asks ``collect`` only when scraped


@dataclass(slots=True)
class MetricsEndpoint:
    url: str
    server: object  # the HTTP server; its thread is a daemon, so a service just exits

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_metrics(registry: CollectorRegistry, listen: str, service: str,
                  json_paths: Mapping[str, Callable[[], object]] | None = None) -> MetricsEndpoint:
    """Serve ``registry`` as Prometheus text at ``http://listen/metrics`` from a daemon thread;
    port 0 picks a free one. Logs the URL (the one line an operator looks for). ``json_paths``:
    paths answered with the JSON of what their function returns (``kvfleet.core.json_endpoint``)."""
    host, port = listen.rsplit(":", 1)
    host = host.strip("[]")
    if json_paths:
        from kvfleet.core.json_endpoint import start_server

        server = start_server(int(port), host, registry, json_paths)
    else:
        server, _thread = start_http_server(int(port), addr=host, registry=registry)
    endpoint = MetricsEndpoint(f"http://{host}:{server.server_port}/metrics", server)
    log.info("%s metrics at %s", service, endpoint.url)
    return endpoint


def metrics_listen(listen: str, port: int) -> str:
    """``host:port`` of the metrics endpoint: on the service's own host (``--listen``'s)."""
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    return f"{host or '0.0.0.0'}:{port}"


def port_parser(flag: str) -> Callable[[object], int]:
    """A setting's ``parse=`` for a TCP port (0-65535; 0: any free one)."""
    def parse(value: object) -> int:
        port = value if isinstance(value, int) and not isinstance(value, bool) else None
        if isinstance(value, str) and value.strip().isdigit():
            port = int(value)
        if port is None or not 0 <= port <= 65535:
            raise ValueError(f"{flag} must be a port (0-65535), got {value!r}")
        return port
    return parse


def metrics_port_setting() -> Any:
    """``--metrics-port`` of every service (a ``kvfleet.core.settings`` field): off unless given, 0
    picks a free port."""
    return setting(None, "serve Prometheus metrics on this port at /metrics, on --listen's host (0: any free port, "
                   "logged)", unset="off", parse=port_parser("--metrics-port"), metavar="PORT")
