"""Which etcd members a client may talk to, and which one it talks to now. Pure: no aetcd, no grpc.

``--etcd`` takes one member or several, comma-separated: ``http://10.0.0.1:2379,10.0.0.2:2379``.
A scheme written on any member applies to those without one (plaintext ``http`` when none is
written; ``https``: mutual TLS), and two different schemes are refused, as are repeats. The
client's glue (``kvfleet.core.etcd_failover``) talks to one member at a time and moves past it when a
call finds it unavailable (``EndpointRotation``).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

DEFAULT_PORT = 2379
SCHEMES = ("http", "https")


@dataclass(slots=True, frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def target(self) -> str:
        """``host:port`` as gRPC takes it (an IPv6 host in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(slots=True, frozen=True)
class EtcdEndpoints:
    scheme: str                       # "http" (plaintext) or "https" (mutual TLS), the same for all
    members: tuple[Endpoint, ...]     # in the order given: the client starts with the first

    def __post_init__(self) -> None:
        assert self.scheme in SCHEMES, self.scheme
        assert self.members, "at least one etcd member"
        assert len(set(self.members)) == len(self.members), "no member twice"

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def url(self) -> str:
        """The list written back as ``--etcd`` takes it."""
        return ",".join(f"{self.scheme}://{m.target}" for m in self.members)


def parse_endpoints(text: str) -> EtcdEndpoints:
    """``--etcd``'s value as a list of members; ValueError (one line) when it is not one."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise ValueError(f"etcd URL must look like http://host:port or https://host:port "
                         f"(several: comma-separated), got {text!r}")
    schemes = {item.split("://", 1)[0] for item in items if "://" in item}
    if len(schemes) > 1:
        raise ValueError(f"etcd members must all be http:// or all https://, got {text!r}")
    scheme = schemes.pop() if schemes else "http"
    members = tuple(_member(item if "://" in item else f"{scheme}://{item}", text) for item in items)
    if len(set(members)) != len(members):
        raise ValueError(f"an etcd member is named twice in {text!r}")
    return EtcdEndpoints(scheme, members)


def _member(url: str, text: str) -> Endpoint:
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port or DEFAULT_PORT
    except ValueError:  # a port that is not a number
        port = None
    if parsed.scheme not in SCHEMES or not parsed.hostname or port is None or parsed.path not in ("", "/"):
        raise ValueError(f"etcd URL must look like http://host:port or https://host:port "
                         f"(several: comma-separated), got {text!r}")
    return Endpoint(parsed.hostname, port)


@dataclass(slots=True)
class EndpointRotation:
    """The member a client talks to now, by index; moved past a member only by a failure seen on
    it, so that calls failing together on one member move the client one member, not several.

    Invariant: ``0 <= current < num_members``."""

    num_members: int
    current: int = 0

    def __post_init__(self) -> None:
        if self.num_members < 1:
            raise ValueError(f"an etcd client needs at least one member, got {self.num_members}")
        assert 0 <= self.current < self.num_members, self.current

    def move_past(self, failed: int) -> bool:
        """Member ``failed`` was found unavailable: talk to the next one (in a ring). False when
        there is no other member, or the client already moved past ``failed``."""
        if self.num_members == 1 or failed != self.current:
            return False
        self.current = (failed + 1) % self.num_members
        return True
