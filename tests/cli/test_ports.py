"""free_port hands out ports no outgoing connection can take, never the same one twice."""

from __future__ import annotations

import socket

from kvfleet.cli import ports


def test_ports_lie_below_the_ephemeral_range_and_are_distinct_and_bindable():
    low = ports._ephemeral_low()
    picked = [ports.free_port() for _ in range(50)]
    assert len(set(picked)) == len(picked)
    if low - ports._FLOOR >= 1000:
        assert all(ports._FLOOR <= p < low for p in picked)
    for port in picked[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_not_handed_out(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: taken + 1)
        monkeypatch.setattr(ports, "_FLOOR", taken - 1000)
        for _ in range(30):
            assert ports.free_port() != taken


def test_a_slice_of_the_range_is_kept_to(monkeypatch):
    monkeypatch.setenv(ports.SLICE_ENV, "1/4")
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32000)
    width = (32000 - ports._FLOOR) // 4
    picked = [ports.free_port() for _ in range(50)]
    assert all(ports._FLOOR + width <= p < ports._FLOOR + 2 * width for p in picked), picked


def test_a_malformed_slice_means_the_whole_range(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: 32000)
    for value in ("", "x", "4/4", "1/0", "1/2/3"):
        monkeypatch.setenv(ports.SLICE_ENV, value)
        assert ports._picking_range() == (ports._FLOOR, 32000)
