"""gRPC health alone, in plaintext, on a port of its own (``--health-port``).

Under mutual TLS every call to a service's port needs a client certificate, and the things that ask
whether a service is up do not have one: Kubernetes' grpc probes speak plaintext, a compose
healthcheck would need a certificate inside every container's check. This second server serves
the same health servicer (the same statuses, set in one place) and nothing else: no data, no
reflection, no method that changes anything. Its setting: ``kvfleet.core.tls_settings.health_port_setting``.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvfleet.core.rpc import NO_REUSEPORT, add_port

log = logging.getLogger(__name__)


async def serve_health_port(health_servicer, listen: str, port: int, service: str) -> grpc.aio.Server:
    """Start the health-only server on ``listen``'s host and ``port``; raises OSError when it cannot bind."""
    from grpc_health.v1 import health_pb2_grpc

    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    server = grpc.aio.server(options=[NO_REUSEPORT])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = add_port(server, f"{host or '0.0.0.0'}:{port}")
    if not bound:
        raise OSError(f"{service}: cannot listen for health on {host}:{port}")
    await server.start()
    log.info("%s: gRPC health (plaintext, nothing else) on %s:%d", service, host, bound)
    return server


class Readiness:
    """What tells the outside whether a service is up, besides its own port: the health-only port
    (``--health-port``) and the watch on its certificate (``kvfleet.core.cert_watch``), which turns
    ``service_name`` NOT_SERVING in the certificate's last hour. ``close()`` stops both."""

    def __init__(self) -> None:
        self.server: grpc.aio.Server | None = None
        self.watch: asyncio.Task | None = None

    @classmethod
    async def start(cls, health_servicer, service_name: str, listen: str, health_port: int | None,
                    warn_days: float, service: str) -> Readiness:
        from grpc_health.v1 import health_pb2

        from kvfleet.core.cert_watch import watch_certificate

        readiness = cls()
        if health_port is not None:
            readiness.server = await serve_health_port(health_servicer, listen, health_port, service)

        async def set_ready(ready: bool) -> None:
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            await health_servicer.set(service_name, status)

        readiness.watch = asyncio.create_task(watch_certificate(service, warn_days, set_ready))
        return readiness

    async def close(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
        if self.server is not None:
            await self.server.stop(grace=0)
