"""Every client's keepalive pings are allowed by every server, read the way gRPC core reads the
options; and every service makes its servers and channels through ``kvfleet.core.rpc``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvfleet.core import keepalive, rpc
from kvfleet.core.keepalive import KeepalivePolicy, violations

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("interval", [keepalive.MIN_PING_INTERVAL_MS, 1_001, 20_000, 3_600_000])
def test_every_client_policy_is_allowed_by_every_server(interval):
    client = KeepalivePolicy(ping_interval_ms=interval).channel_options()
    assert violations(client, keepalive.server_options()) == []
    assert violations(client, rpc.server_options()) == []
    assert violations(client, rpc.server_options(max_send_bytes=rpc.MAX_MESSAGE_BYTES)) == []


def test_the_fleets_own_channels_are_allowed(monkeypatch):
    for env in ("", "1000", "45000"):
        monkeypatch.setenv(keepalive.ENV_VAR, env)
        for max_receive in (None, rpc.MAX_MESSAGE_BYTES):
            assert violations(rpc.channel_options(max_receive), rpc.server_options()) == []


def test_the_settings_that_sent_goaway_are_caught():
    """The router pinged its nodes every 20 s; the node's server meant to allow one every 10 s
    but misspelt the option's name, so gRPC kept its five-minute default."""
    router_channel = [("grpc.max_receive_message_length", 64 << 20), ("grpc.keepalive_time_ms", 20_000),
                      ("grpc.keepalive_timeout_ms", 10_000)]
    compute_server = [("grpc.max_receive_message_length", 64 << 20),
                      ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
                      ("grpc.keepalive_permit_without_calls", 1)]
    assert violations(router_channel, compute_server) == [
        "server option 'grpc.http2.min_recv_ping_interval_without_data_ms' is not one gRPC knows: it is ignored",
        "the client pings every 20000 ms; the server allows one every 300000 ms (it must allow at least two "
        "per interval)",
    ]
    # pings with no call open need the server's permission too
    idle_client = KeepalivePolicy().channel_options()
    assert violations(idle_client, [(keepalive.MIN_RECV_PING_INTERVAL, 500)]) == [
        "the client pings with no call open; the server allows that once every 7200000 ms"]
    # a server allowing exactly the interval strikes a ping that comes a tick early
    assert len(violations(KeepalivePolicy(2_000).channel_options(), [(keepalive.MIN_RECV_PING_INTERVAL, 2_000),
                                                                     (keepalive.PERMIT_WITHOUT_CALLS, 1)])) == 1


def test_the_interval_from_the_environment():
    assert KeepalivePolicy.from_env({}) == KeepalivePolicy()
    assert KeepalivePolicy.from_env({keepalive.ENV_VAR: " "}) == KeepalivePolicy()
    assert KeepalivePolicy.from_env({keepalive.ENV_VAR: "1000"}) == KeepalivePolicy(1_000, 1_000)
    assert KeepalivePolicy.from_env({keepalive.ENV_VAR: "60000"}) == KeepalivePolicy(60_000, 10_000)
    with pytest.raises(ValueError, match="whole number of milliseconds"):
        KeepalivePolicy.from_env({keepalive.ENV_VAR: "1s"})
    with pytest.raises(ValueError, match="at least 1000 ms"):
        KeepalivePolicy.from_env({keepalive.ENV_VAR: "999"})


def test_a_bad_interval_in_the_environment_falls_back_to_the_default(monkeypatch):
    monkeypatch.setenv(keepalive.ENV_VAR, "often")
    assert rpc.keepalive_policy() == KeepalivePolicy()


# the services, and the command line's clients that hold long streams
SERVICE_SOURCES = [*(ROOT / "kvfleet" / "router").rglob("*.py"), *(ROOT / "kvfleet" / "compute_service").rglob("*.py"),
                   *(ROOT / "kvfleet" / "block_service").rglob("*.py"), ROOT / "kvfleet" / "cli" / "generate_client.py"]
MAKERS = {"insecure_channel", "secure_channel", "server"}


def _grpc_makers(path: Path) -> list[str]:
    """``grpc.insecure_channel(...)``, ``grpc.aio.server(...)`` and the like called in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MAKERS:
            owner = ast.unparse(node.func.value)
            if owner in ("grpc", "grpc.aio"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {owner}.{node.func.attr}")
    return found


def test_services_make_servers_and_channels_through_kvfleet_rpc():
    assert [found for path in SERVICE_SOURCES for found in _grpc_makers(path)] == []
