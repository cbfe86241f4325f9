"""A metrics endpoint that also answers a few paths with JSON (the router's ``/canary/samples``).

Prometheus text is for aggregates; some figures are only useful as raw records (per-request outcomes
for a bootstrap), and they belong next to the metrics, on the same port and under the same access
rules. Every path not named here answers as ``prometheus_client`` does.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvfleet.core.backoff import error_line


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


def start_server(port: int, host: str, registry: CollectorRegistry,
                 json_paths: Mapping[str, Callable[[], object]]):
    """The HTTP server on ``host:port`` (a daemon thread serves it): ``json_paths`` as JSON, the rest metrics."""
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        read = json_paths.get(environ.get("PATH_INFO", ""))
        if read is None:
            return metrics_app(environ, start_response)
        try:
            body, status = json.dumps(read()).encode(), "200 OK"
        except Exception as e:  # noqa: BLE001 - the caller sees why, the service goes on
            body, status = json.dumps({"error": error_line(e)}).encode(), "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
        return [body]

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    httpd = make_server(host, port, app, Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True, name="metrics-http").start()
    return httpd
