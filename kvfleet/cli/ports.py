"""Free loopback ports for the processes the local cluster, the tests and the benchmarks start.

Asking the kernel for port 0 hands out a port from its *ephemeral* range
(``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768–60999): the same range it takes the
local port of every outgoing connection from. A port picked that way and bound only later (a router
starts after its nodes load the model) can meanwhile become the local end of some process's gRPC or
etcd connection, and the service then fails with "the port is taken". So the ports picked here lie
below the ephemeral range, where no outgoing connection lands; each one is checked free by binding
it, and one process never hands out the same port twice.

``KVFLEET_PORT_SLICE=i/n`` (in the environment, inherited by children) narrows that range to its i-th of n
equal slices (i from 0): processes started under different slices never pick the same port, as the
parallel test workers' clusters must not (tests/conftest.py gives each xdist worker its own).
"""

from __future__ import annotations

import os
import random
import socket
import threading

_FLOOR = 20000  # above the well-known and most registered service ports
_DEFAULT_EPHEMERAL_LOW = 32768
_MIN_ROOM = 256  # ports a range needs to be picked from (fewer: the kernel's choice)
SLICE_ENV = "KVFLEET_PORT_SLICE"
_given: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _kernel_choice(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _picking_range() -> tuple[int, int]:
    """[start, end) to pick from: below the ephemeral range, this process's slice of it if it has one
    (a malformed ``KVFLEET_PORT_SLICE``: the whole range)."""
    start, end = _FLOOR, _ephemeral_low()
    try:
        i, n = (int(part) for part in os.environ.get(SLICE_ENV, "0/1").split("/"))
    except ValueError:
        return start, end
    if n < 1 or not 0 <= i < n:
        return start, end
    width = (end - start) // n
    return start + i * width, start + (i + 1) * width


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host``, outside the kernel's ephemeral range when there is room below
    it (within this process's ``KVFLEET_PORT_SLICE``), and not handed out before by this process.
    Another process may still take it later, but no outgoing connection will."""
    start, end = _picking_range()
    with _lock:
        if end - start >= _MIN_ROOM:
            for _ in range(200):
                port = random.randrange(start, end)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
        port = _kernel_choice(host)
        _given.add(port)
        return port
