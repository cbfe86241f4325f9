"""The delay proxy on loopback, in this process (no namespace, no root): a proxy told where to go (as
``SO_ORIGINAL_DST`` would tell it) delays the direction its namespace sends — out when the target is
another address, back when a peer dialled this address — by at least the configured minimum; bytes
arrive whole and in order under jitter; the half-close passes through; the heal releases what waits;
a failed dial resets the client. Lower bounds only: the fault is there, how fast is not checked."""

from __future__ import annotations

import asyncio

from kvfleet.cli.partition.delay_proxy import DelayProxy

DELAY_S, JITTER_S = 0.2, 0.1


class _ProxyTo(DelayProxy):
    """A proxy whose every connection goes to ``target`` (no conntrack here)."""

    def __init__(self, target: tuple[str, int], delay_s: float, jitter_s: float) -> None:
        super().__init__(delay_s, jitter_s, seed=1, mark=None)
        self.fixed = target

    def target(self, writer):
        return self.fixed


async def _echo(host: str, log: list) -> asyncio.Server:
    """An echo server that logs ``(arrived, echoed)`` loop times of each chunk."""
    loop = asyncio.get_running_loop()

    async def handle(reader, writer):
        while data := await reader.read(1 << 16):
            arrived = loop.time()
            writer.write(data)
            await writer.drain()
            log.append((arrived, loop.time()))
        writer.close()

    return await asyncio.start_server(handle, host, 0)


async def _through(proxy: DelayProxy, host: str = "127.0.0.1"):
    server = await asyncio.start_server(proxy.serve, host, 0)
    return server, *(await asyncio.open_connection(host, server.sockets[0].getsockname()[1]))


async def _round_trips(echo_host: str, count: int = 4) -> list[tuple[float, float, float, float]]:
    """(sent, arrived at the server, echoed, received back) for ``count`` pings through a proxy at
    127.0.0.1 to an echo server at ``echo_host``."""
    loop, log = asyncio.get_running_loop(), []
    echo = await _echo(echo_host, log)
    proxy = _ProxyTo((echo_host, echo.sockets[0].getsockname()[1]), DELAY_S, JITTER_S)
    server, reader, writer = await _through(proxy)
    trips = []
    for i in range(count):
        sent = loop.time()
        writer.write(b"ping %d" % i)
        assert await reader.readexactly(6) == b"ping %d" % i
        trips.append((sent, *log[-1], loop.time()))
    writer.close()
    server.close()
    echo.close()
    return trips


def test_dialling_out_delays_what_this_side_sends():
    trips = asyncio.run(_round_trips("127.0.0.2"))  # another address: the proxy dials out
    assert all(arrived - sent >= DELAY_S - JITTER_S for sent, arrived, _, _ in trips), trips


def test_dialled_in_delays_what_the_service_here_sends_back():
    trips = asyncio.run(_round_trips("127.0.0.1"))  # the proxy's own address: a peer dialled in
    assert all(received - echoed >= DELAY_S - JITTER_S for _, _, echoed, received in trips), trips


def test_bytes_arrive_whole_and_in_order_and_the_half_close_passes():
    async def scenario():
        echo = await _echo("127.0.0.2", [])
        proxy = _ProxyTo(("127.0.0.2", echo.sockets[0].getsockname()[1]), 0.02, 0.02)
        server, reader, writer = await _through(proxy)
        sent = b"".join(i.to_bytes(4, "big") * 250 for i in range(200))
        for k in range(0, len(sent), 1000):
            writer.write(sent[k:k + 1000])
            await writer.drain()
            await asyncio.sleep(0.001 * (k % 3))
        writer.write_eof()
        received = await asyncio.wait_for(reader.read(), 60)  # to the end: the echo closes after ours
        writer.close()
        server.close()
        echo.close()
        return sent, received

    sent, received = asyncio.run(scenario())
    assert received == sent


def test_the_heal_releases_what_waits():
    async def scenario():
        echo = await _echo("127.0.0.2", [])
        proxy = _ProxyTo(("127.0.0.2", echo.sockets[0].getsockname()[1]), 3600.0, 0.0)  # an hour
        server, reader, writer = await _through(proxy)
        writer.write(b"held")
        await asyncio.sleep(0.2)
        proxy.heal()
        data = await asyncio.wait_for(reader.readexactly(4), 60)  # within the test, not the hour
        writer.close()
        server.close()
        echo.close()
        return data

    assert asyncio.run(scenario()) == b"held"


def test_a_failed_dial_resets_the_client():
    async def scenario():
        with_nothing = await asyncio.start_server(lambda r, w: None, "127.0.0.2", 0)
        port = with_nothing.sockets[0].getsockname()[1]
        with_nothing.close()
        await with_nothing.wait_closed()  # the port refuses now
        server, reader, writer = await _through(_ProxyTo(("127.0.0.2", port), DELAY_S, 0.0))
        try:
            return await asyncio.wait_for(reader.read(), 60)
        except ConnectionResetError:
            return "reset"
        finally:
            writer.close()
            server.close()

    assert asyncio.run(scenario()) == "reset"
