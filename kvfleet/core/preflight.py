"""Checks a service runs before its slow start (loading a model, recovering a log), so that what a
person got wrong is answered at once in one line: a port already taken, a peer (etcd,
block_service) that nobody answers at.

A peer may be starting at the same moment (``kvfleet up``, compose, Kubernetes start everything
together), so ``wait_reachable`` waits for it a while, saying so once, before giving up. Pure:
sockets only, no grpc.
"""

from __future__ import annotations

import errno
import socket
import time
import urllib.parse
from collections.abc import Callable


class PreflightError(Exception):
    """What is wrong, in one line for a person."""


def host_port(address: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``http://host:port`` → (host, port)."""
    parsed = urllib.parse.urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parsed.port
    except ValueError:
        port = None
    if port is None or not parsed.hostname:
        raise PreflightError(f"{address!r} is not a host:port address")
    return parsed.hostname, port


def check_port_free(listen: str, purpose: str = "") -> None:
    """Raise if nothing could listen on ``listen`` now (port 0, "any port", always passes);
    ``purpose`` (e.g. "HTTP") is named in the error when a process listens on several ports.

    gRPC servers bind with SO_REUSEPORT, so a second one would silently share a taken port; a
    plain bind without it fails on a port any other process listens on."""
    host, port = host_port(listen)
    if port == 0:
        return
    where = f"{listen} for {purpose}" if purpose else listen
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PreflightError(f"cannot listen on {where}: unknown host {host!r} ({exc.strerror})") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is not "taken"
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            why = "the port is taken by another process" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise PreflightError(f"cannot listen on {where}: {why}") from None


def check_side_ports_free(listen: str, metrics_port: int | None, health_port: int | None) -> None:
    """``check_port_free`` for a service's metrics and health ports (on ``--listen``'s host), when set."""
    host = listen.rsplit(":", 1)[0] if ":" in listen else listen
    for port, what in ((metrics_port, "metrics"), (health_port, "health")):
        if port is not None:
            check_port_free(f"{host or '0.0.0.0'}:{port}", what)


def reachable(address: str, timeout_s: float = 1.0) -> str | None:
    """None when a TCP connection to ``address`` opens (to any one of a comma-separated list, as
    etcd's members are given: ``http://a:2379,http://b:2379``), else why not (the last one's why)."""
    why = None
    for host, port in [host_port(one.strip()) for one in address.split(",")]:
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return None
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
    return why


def wait_reachable(what: str, address: str, timeout_s: float, on_wait: Callable[[str], None],
                   every_s: float = 0.5) -> None:
    """Return once ``address`` accepts a connection; ``on_wait`` hears once that we wait; raise
    ``PreflightError`` after ``timeout_s`` without one."""
    deadline = time.monotonic() + timeout_s
    why = reachable(address)
    if why is None:
        return
    on_wait(f"waiting for {what} at {address} ({why}), up to {timeout_s:g} s")
    while time.monotonic() < deadline:
        time.sleep(every_s)
        why = reachable(address)
        if why is None:
            return
    raise PreflightError(f"{what} at {address} is unreachable ({why}) after {timeout_s:g} s")
