"""One keepalive policy for every gRPC channel and server of the fleet (pure: option lists only).

A client pings an idle connection every ``ping_interval_ms`` so that a peer whose host vanished
without closing its sockets is noticed (router → nodes, router → block_service, node →
block_service, command-line clients → router). A gRPC server counts each ping that comes sooner
than it allows as a strike and, past two strikes, answers GOAWAY ENHANCE_YOUR_CALM "too_many_pings",
which breaks every stream on the connection. So the two sides are set here together:

    client  keepalive_time_ms = ping_interval_ms   (>= MIN_PING_INTERVAL_MS, 20 s by default)
            keepalive_permit_without_calls = 1     ping an idle channel too
            http2.max_pings_without_data = 0       keep pinging a stream that carries no data
    server  http2.min_ping_interval_without_data_ms = MIN_PING_INTERVAL_MS / 2
            keepalive_permit_without_calls = 1

Every server allows pings at half the shortest interval any client may use, so no setting of a
client, from the default to ``KVFLEET_KEEPALIVE_MS``'s lowest, can earn a strike, whatever the
other processes were started with.

The router's channels to the nodes ping faster (``node_link``: every second, closed when an answer
is 1.5 s late): a node the router can no longer reach is noticed within ~2.5 s, its Serve stream
breaks and the router resumes that stream's requests on another node. gRPC's transport answers a
ping itself, whatever the node's engine is doing, so a long prefill (no token for seconds) never
looks like a dead link; only a link that carries nothing back does. ``violations`` reads a pair of option lists the way gRPC core
does (unknown names are ignored by gRPC: a misspelt one is how the servers once kept the
five-minute default and sent GOAWAY after a minute of idle).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ENV_VAR = "KVFLEET_KEEPALIVE_MS"  # a client's ping interval (tests shorten it to see strikes quickly)
MIN_PING_INTERVAL_MS = 1_000
DEFAULT_PING_INTERVAL_MS = 20_000
DEFAULT_PING_TIMEOUT_MS = 10_000
SERVER_MIN_PING_INTERVAL_MS = MIN_PING_INTERVAL_MS // 2  # half: timer jitter never makes a strike
NODE_LINK_PING_INTERVAL_MS = MIN_PING_INTERVAL_MS  # router → node: a dead link found in interval + timeout
NODE_LINK_PING_TIMEOUT_MS = 1_500

# gRPC core's names (channel_arg_names.h) and the defaults it uses when one is not given
KEEPALIVE_TIME = "grpc.keepalive_time_ms"
KEEPALIVE_TIMEOUT = "grpc.keepalive_timeout_ms"
PERMIT_WITHOUT_CALLS = "grpc.keepalive_permit_without_calls"
MAX_PINGS_WITHOUT_DATA = "grpc.http2.max_pings_without_data"
MIN_RECV_PING_INTERVAL = "grpc.http2.min_ping_interval_without_data_ms"
MAX_PING_STRIKES = "grpc.http2.max_ping_strikes"
SERVER_DEFAULT_MIN_RECV_PING_INTERVAL_MS = 300_000
IDLE_SERVER_MIN_RECV_PING_INTERVAL_MS = 7_200_000  # no call open and pings without calls not permitted
KNOWN_OPTIONS = frozenset({
    KEEPALIVE_TIME, KEEPALIVE_TIMEOUT, PERMIT_WITHOUT_CALLS, MAX_PINGS_WITHOUT_DATA, MIN_RECV_PING_INTERVAL,
    MAX_PING_STRIKES, "grpc.max_receive_message_length", "grpc.max_send_message_length", "grpc.so_reuseport",
})

Options = Sequence[tuple[str, int]]


@dataclass(slots=True, frozen=True)
class KeepalivePolicy:
    ping_interval_ms: int = DEFAULT_PING_INTERVAL_MS  # a client pings an idle connection this often
    ping_timeout_ms: int = DEFAULT_PING_TIMEOUT_MS    # and closes it when the answer is this late

    def __post_init__(self) -> None:
        if self.ping_interval_ms < MIN_PING_INTERVAL_MS:
            raise ValueError(f"keepalive ping interval must be at least {MIN_PING_INTERVAL_MS} ms "
                             f"(what every server allows), got {self.ping_interval_ms}")
        if self.ping_timeout_ms < 1:
            raise ValueError(f"keepalive ping timeout must be at least 1 ms, got {self.ping_timeout_ms}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> KeepalivePolicy:
        """The default policy, or the ping interval ``KVFLEET_KEEPALIVE_MS`` sets (the timeout no
        longer than the interval); raises ValueError for a value that is not one."""
        raw = environ.get(ENV_VAR, "").strip()
        if not raw:
            return cls()
        try:
            interval = int(raw)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a whole number of milliseconds, got {raw!r}") from None
        return cls(ping_interval_ms=interval, ping_timeout_ms=min(DEFAULT_PING_TIMEOUT_MS, interval))

    def node_link(self) -> KeepalivePolicy:
        """This policy for a router → node channel: pinging at least every
        ``NODE_LINK_PING_INTERVAL_MS`` and giving up after at most ``NODE_LINK_PING_TIMEOUT_MS``."""
        return KeepalivePolicy(min(self.ping_interval_ms, NODE_LINK_PING_INTERVAL_MS),
                               min(self.ping_timeout_ms, NODE_LINK_PING_TIMEOUT_MS))

    def channel_options(self) -> list[tuple[str, int]]:
        return [
            (KEEPALIVE_TIME, self.ping_interval_ms),
            (KEEPALIVE_TIMEOUT, self.ping_timeout_ms),
            (PERMIT_WITHOUT_CALLS, 1),
            (MAX_PINGS_WITHOUT_DATA, 0),
        ]


def server_options() -> list[tuple[str, int]]:
    """What every server allows: any client of any valid ``KeepalivePolicy``."""
    return [(MIN_RECV_PING_INTERVAL, SERVER_MIN_PING_INTERVAL_MS), (PERMIT_WITHOUT_CALLS, 1)]


def violations(client: Options, server: Options) -> list[str]:
    """Why ``server`` would strike the keepalive pings of ``client`` (empty: it never does), and
    any option name gRPC does not know, on either side."""
    found = [f"{side} option {name!r} is not one gRPC knows: it is ignored"
             for side, options in (("client", client), ("server", server))
             for name, _ in options if name not in KNOWN_OPTIONS]
    c, s = dict(client), dict(server)
    interval = c.get(KEEPALIVE_TIME)
    if interval is None:
        return found  # the client never pings
    allowed = s.get(MIN_RECV_PING_INTERVAL, SERVER_DEFAULT_MIN_RECV_PING_INTERVAL_MS)
    if 2 * allowed > interval:  # at the interval exactly, a ping that comes early by a tick is a strike
        found.append(f"the client pings every {interval} ms; the server allows one every {allowed} ms "
                     f"(it must allow at least two per interval)")
    if c.get(PERMIT_WITHOUT_CALLS, 0) and not s.get(PERMIT_WITHOUT_CALLS, 0):
        found.append(f"the client pings with no call open; the server allows that once every "
                     f"{IDLE_SERVER_MIN_RECV_PING_INTERVAL_MS} ms")
    return found
