"""The router's channels to the nodes ping faster than the fleet's default (``KeepalivePolicy.node_link``)
so that a node the router cannot reach any more is found in seconds, and every server still allows it."""

from __future__ import annotations

from kvfleet.core import keepalive, rpc
from kvfleet.core.keepalive import KEEPALIVE_TIME, KEEPALIVE_TIMEOUT, KeepalivePolicy, violations


def test_a_node_link_pings_every_second_and_gives_up_after_a_second_and_a_half():
    link = KeepalivePolicy().node_link()
    assert (link.ping_interval_ms, link.ping_timeout_ms) == (keepalive.NODE_LINK_PING_INTERVAL_MS,
                                                             keepalive.NODE_LINK_PING_TIMEOUT_MS) == (1_000, 1_500)
    assert violations(link.channel_options(), rpc.server_options()) == []


def test_a_node_link_is_never_slower_than_the_process_policy():
    faster = KeepalivePolicy(ping_interval_ms=1_000, ping_timeout_ms=200).node_link()
    assert (faster.ping_interval_ms, faster.ping_timeout_ms) == (1_000, 200)
    slower = KeepalivePolicy(ping_interval_ms=3_600_000, ping_timeout_ms=60_000).node_link()
    assert (slower.ping_interval_ms, slower.ping_timeout_ms) == (1_000, 1_500)


def test_the_channel_options_take_the_policy_given(monkeypatch):
    monkeypatch.setenv(keepalive.ENV_VAR, "45000")
    default = dict(rpc.channel_options())
    link = dict(rpc.channel_options(rpc.MAX_MESSAGE_BYTES, rpc.keepalive_policy().node_link()))
    assert (default[KEEPALIVE_TIME], default[KEEPALIVE_TIMEOUT]) == (45_000, 10_000)
    assert (link[KEEPALIVE_TIME], link[KEEPALIVE_TIMEOUT]) == (1_000, 1_500)
    assert link["grpc.max_receive_message_length"] == rpc.MAX_MESSAGE_BYTES
