"""A transparent TCP delay proxy: delay and jitter for the partition bed on a kernel without
``tc netem`` (``netns.Netbed.delay``). One process per delayed namespace, started inside it:

    python -m kvfleet.cli.partition.delay_proxy --listen PORT --delay-ms D --jitter-ms J [--seed S]

``redirect_rules`` (iptables ``nat``, installed by the bed) hand it every TCP connection that crosses
the namespace's ``eth0`` within the bed's subnet, whichever end dialled:

- OUTPUT: a service here dials out (here → b): the proxy dials b and delays what this side sends;
- PREROUTING: a peer dials in (b → a service here): the proxy dials the service at this namespace's
  own address and delays what the service sends back.

So the proxy delays exactly the bytes its namespace sends onto the bridge, as netem on ``eth0``'s
egress would: with every service delayed (``lossy``) each connection is delayed once each way, in the
client's namespace one way and in the server's the other; the root namespace's clients (never
delayed themselves) see the services' replies delayed. Which end dialled: the connection's original
destination (``SO_ORIGINAL_DST``) is this namespace's own address (in) or another's (out).

The proxy's own connections carry ``MARK`` (``SO_MARK``) and the OUTPUT rule skips it: the proxy runs
as root like the services (an owner match cannot tell them apart) and dials the ports they dial (a
port match cannot either). Its inward dial goes to the namespace's own address over ``lo``, which no
rule matches.

Not delayed: the TCP handshake (the proxy accepts at once, then dials) and UDP. A failed dial (a cut,
a refused port) resets the accepted connection. Connections open before the rules go in are reset
by them (conntrack picks one up mid-stream, the redirection sends its next packet to this port,
which answers RST): the onset of a delay costs each open connection one reconnect, through the
proxy. SIGTERM (the heal) stops accepting and switches the delay off (queued chunks go out at once,
in order); connections already carried keep working (conntrack keeps their translation once the
rules are gone, as long as something keeps conntrack on: ``netns``) and the proxy exits when the
last one closes. It prints ``listening`` once it accepts and ``draining`` once it no longer does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import socket
import struct

from kvfleet.cli.partition.delay_schedule import DelaySchedule

MARK = 0x6B76            # the proxy's own connections ("kv"); the OUTPUT rule lets them pass
SO_ORIGINAL_DST = 80     # linux/netfilter_ipv4.h
CHUNK = 64 << 10
QUEUE_CHUNKS = 256       # a direction stops reading while this many chunks wait: TCP's backpressure
DIAL_TIMEOUT_S = 30.0


def redirect_rules(subnet_cidr: str, port: int) -> list[list[str]]:
    """The ``iptables -t nat -A`` arguments that hand a namespace's bed connections to the proxy."""
    to_proxy = ["-j", "REDIRECT", "--to-ports", str(port)]
    return [["OUTPUT", "-o", "eth0", "-p", "tcp", "-d", subnet_cidr, "-m", "mark", "!", "--mark", hex(MARK),
             *to_proxy],
            ["PREROUTING", "-i", "eth0", "-p", "tcp", "-s", subnet_cidr, *to_proxy]]


def original_destination(sock: socket.socket) -> tuple[str, int]:
    """Where a redirected connection was going (``struct sockaddr_in`` from conntrack)."""
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return socket.inet_ntoa(raw[4:8]), int.from_bytes(raw[2:4], "big")


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), as a refused or broken connection looks to its peer."""
    with contextlib.suppress(OSError, AttributeError):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class DelayProxy:
    """The connections of one namespace, each direction with its ``DelaySchedule`` (or none); its own
    dials carry ``mark`` (None: unmarked, for a test's proxy, which no rule redirects to)."""

    def __init__(self, delay_s: float, jitter_s: float, seed: int | None = None, mark: int | None = MARK) -> None:
        self.delay_s, self.jitter_s, self.mark = delay_s, jitter_s, mark
        self.rng = random.Random(seed)
        self.healed = asyncio.Event()
        self.schedules: set[DelaySchedule] = set()
        self.connections: set[asyncio.Task] = set()

    def heal(self) -> None:
        """Delay off: what waits goes out now, what comes later as soon as what is ahead of it."""
        for schedule in self.schedules:
            schedule.switch_off()
        self.delay_s = self.jitter_s = 0.0
        self.healed.set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        try:
            await self._carry(reader, writer)
        finally:
            self.connections.discard(task)
            writer.close()

    def target(self, writer: asyncio.StreamWriter) -> tuple[str, int] | None:
        """Where an accepted connection was going; None: nowhere (dialled directly, not redirected)."""
        try:
            target = original_destination(writer.get_extra_info("socket"))
        except OSError:
            return None
        return None if target == writer.get_extra_info("sockname")[:2] else target

    async def _carry(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = self.target(writer)
        if target is None:
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(self._dial(target), DIAL_TIMEOUT_S)
        except (OSError, TimeoutError):
            _reset(writer)
            return
        sends = DelaySchedule(self.delay_s, self.jitter_s, self.rng)  # what this namespace sends out
        self.schedules.add(sends)
        inbound = target[0] == writer.get_extra_info("sockname")[0]  # a peer dialled a service here
        try:
            await asyncio.gather(self._pipe(reader, writer, up_writer, None if inbound else sends),
                                 self._pipe(up_reader, up_writer, writer, sends if inbound else None))
        finally:
            self.schedules.discard(sends)
            up_writer.close()

    async def _dial(self, target: tuple[str, int]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.mark is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, self.mark)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, target)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock)

    async def _pipe(self, src: asyncio.StreamReader, src_writer: asyncio.StreamWriter,
                    dst: asyncio.StreamWriter, schedule: DelaySchedule | None) -> None:
        """``src``'s bytes to ``dst``, each chunk at its time (``schedule``; None: as read), its end
        passed on as a half-close; an error on either side resets both."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(QUEUE_CHUNKS)
        deliver = asyncio.create_task(self._deliver(queue, dst, src_writer))
        try:
            while True:
                data = await src.read(CHUNK)
                now = loop.time()
                await queue.put((now if schedule is None else schedule.deliver_at(now), data))
                if not data:
                    break
            await deliver
        except OSError:
            _reset(src_writer)
            _reset(dst)
        finally:
            deliver.cancel()

    async def _deliver(self, queue: asyncio.Queue, dst: asyncio.StreamWriter, src_writer: asyncio.StreamWriter) -> None:
        """Writes each queued chunk at its time, then the half-close. Once a write failed it resets
        both sides and drops the rest until the end (so the reader never blocks on a full queue)."""
        broken = False
        while True:
            at, data = await queue.get()
            if broken:
                if not data:
                    return
                continue
            try:
                await self._until(at)
                if not data:
                    if dst.can_write_eof():
                        dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()
            except OSError:
                broken = True
                _reset(src_writer)
                _reset(dst)
                if not data:
                    return

    async def _until(self, at: float) -> None:
        """Sleep until ``at`` (the loop's clock), or until the heal."""
        wait = at - asyncio.get_running_loop().time()
        if wait > 0 and not self.healed.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.healed.wait(), wait)

async def run(port: int, proxy: DelayProxy) -> None:
    """Serve until SIGTERM, then drain: exit once the last carried connection closes."""
    server = await asyncio.start_server(proxy.serve, "0.0.0.0", port, backlog=1024)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("listening", flush=True)
    await stop.wait()
    server.close()  # the listening socket closes now; the carried connections stay
    proxy.heal()
    print("draining", flush=True)
    while proxy.connections:
        await asyncio.wait(set(proxy.connections))


def main(argv: list[str] | None = None) -> None:
    from kvfleet.core import parent_death

    parent_death.arm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=int, required=True, help="the port the REDIRECT rules send to")
    parser.add_argument("--delay-ms", type=float, required=True)
    parser.add_argument("--jitter-ms", type=float, default=0.0, help="each chunk's delay ± uniform jitter")
    parser.add_argument("--seed", type=int, default=None, help="the jitter's random seed")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or args.jitter_ms < 0:
        parser.error("--delay-ms and --jitter-ms are never negative")
    asyncio.run(run(args.listen, DelayProxy(args.delay_ms / 1000, args.jitter_ms / 1000, args.seed)))


if __name__ == "__main__":
    main()
