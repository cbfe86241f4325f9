"""The router's memory of where it just sent a prefix (pure)."""

from __future__ import annotations

import pytest

from kvfleet.router.recent_routes import RecentRoutes


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_leading_blocks_per_node_and_expiry():
    clock = Clock()
    recent = RecentRoutes(ttl_s=10, clock=clock)
    recent.record("a", [b"h1", b"h2", b"h3"])
    recent.record("b", [b"h1"])
    assert recent.match([b"h1", b"h2", b"h3", b"h4"], ["a", "b", "c"]) == {"a": 3, "b": 1}
    assert recent.match([b"h2"], ["a"]) == {"a": 1}       # membership per block, order from the caller
    assert recent.match([b"x", b"h1"], ["a"]) == {}        # a chain that starts elsewhere is not a prefix
    clock.now = 10.5
    assert recent.match([b"h1"], ["a", "b"]) == {}


def test_recording_again_refreshes_and_the_size_is_bounded():
    clock = Clock()
    recent = RecentRoutes(ttl_s=10, max_entries=3, clock=clock)
    recent.record("a", [b"h1", b"h2"])
    clock.now = 8
    recent.record("a", [b"h1"])
    clock.now = 12
    assert recent.match([b"h1", b"h2"], ["a"]) == {"a": 1}
    recent.record("b", [b"x1", b"x2", b"x3"])              # evicts the oldest entries first
    assert recent.match([b"h1"], ["a"]) == {} and recent.match([b"x1", b"x2", b"x3"], ["b"]) == {"b": 3}


def test_forget_node_and_bad_settings():
    recent = RecentRoutes()
    recent.record("a", [b"h1"])
    recent.record("b", [b"h1"])
    recent.forget_node("a")
    assert recent.match([b"h1"], ["a", "b"]) == {"b": 1}
    with pytest.raises(ValueError):
        RecentRoutes(ttl_s=0)
