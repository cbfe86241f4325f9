"""Free loopback ports for the processes the local cluster, the tests and the benchmarks start.

Asking the kernel for port 0 hands out a port from its *ephemeral* range
(``/proc/sys/net/ipv4/ip_local_port_range``, usually 32768–60999): the same range it takes the
local port of every outgoing connection from. A port picked that way and bound only later (a router
starts after its nodes load the model) can meanwhile become the local end of some process's gRPC or
etcd connection, and the service then fails with "the port is taken". So the ports picked here lie
below the ephemeral range, where no outgoing connection lands; each one is checked free by binding
it, and one process never hands out the same port twice.
"""

from __future__ import annotations

import random
import socket
import threading

_FLOOR = 20000  # above the well-known and most registered service ports
_DEFAULT_EPHEMERAL_LOW = 32768
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


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on ``host``, outside the kernel's ephemeral range when there is room below
    it, and not handed out before by this process. Another process may still take it later, but no
    outgoing connection will."""
    low = _ephemeral_low()
    with _lock:
        if low - _FLOOR >= 1000:
            for _ in range(200):
                port = random.randrange(_FLOOR, low)
                if port not in _given and _bindable(host, port):
                    _given.add(port)
                    return port
        port = _kernel_choice(host)
        _given.add(port)
        return port
