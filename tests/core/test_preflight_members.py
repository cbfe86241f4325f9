"""Preflight's reachability over a list of etcd members (kvfleet.core.preflight.reachable): any one that
accepts a connection is enough. Loopback sockets only."""

from __future__ import annotations

import socket

from kvfleet.core.preflight import reachable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_any_member_that_accepts_is_enough():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = listening.getsockname()[1]
        down = _closed_port()
        assert reachable(f"http://127.0.0.1:{down},http://127.0.0.1:{up}") is None
        assert reachable(f"127.0.0.1:{up}") is None
    assert reachable(f"http://127.0.0.1:{_closed_port()},127.0.0.1:{_closed_port()}") is not None
