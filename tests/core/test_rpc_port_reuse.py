"""A kvfleet server's port is its own: a second server asked to bind it fails, where gRPC's default
(SO_REUSEPORT) would let both bind and split the connections between them."""

from __future__ import annotations

import asyncio

import pytest
from grpc_health.v1.health import aio as health_aio

from kvfleet.cli.ports import free_port
from kvfleet.core import rpc
from kvfleet.core.health_port import serve_health_port


def test_a_second_server_cannot_bind_a_port_already_bound():
    async def main():
        port = free_port()
        first = rpc.server()
        assert first.add_insecure_port(f"127.0.0.1:{port}") == port
        await first.start()
        try:
            second = rpc.server()
            with pytest.raises(RuntimeError):  # grpc: "Failed to bind to address"
                second.add_insecure_port(f"127.0.0.1:{port}")
            with pytest.raises(OSError, match="cannot listen for health"):
                await serve_health_port(health_aio.HealthServicer(), "127.0.0.1:0", port, "test")
        finally:
            await first.stop(None)

    asyncio.run(main())
