"""Who is calling: the fleet's service identities, as their certificates name them. Pure.

Every internal connection is mutual TLS under one cluster CA (``kvfleet.core.certs``, ``kvfleet.core.tls``),
and every certificate names one identity in its subject's common name:

    router           the router (the only caller that starts requests on a node)
    block-service    a block_service replica (a standby follows the leader's log with it)
    node:<id>        compute node <id> (writes only its own node's blocks and sequences)
    admin            an operator (tenant changes, node removal, every read)
    etcd             the etcd server

The same name is the etcd user of a client certificate (etcd takes the common name as the user),
so etcd's roles fence the membership keys by the same identities. A certificate also carries its
identity's *host name* (``host_name``) as a DNS name: a client connecting to a peer asks for that
name (gRPC's target name override), so an address (an IP in a pod, a port on loopback) is never
what is trusted, the peer's certificate is: a node that presents another node's certificate is
refused at the handshake.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

ROUTER, BLOCK_SERVICE, ADMIN, ETCD, NODE = "router", "block-service", "admin", "etcd", "node"
SINGLE_KINDS = (ROUTER, BLOCK_SERVICE, ADMIN, ETCD)
_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
DOMAIN = "kvfleet"


@dataclass(frozen=True, slots=True, order=True)
class Identity:
    kind: str
    node_id: str = ""

    def __post_init__(self) -> None:
        if self.kind == NODE:
            if not _NODE_ID.fullmatch(self.node_id):
                raise ValueError(f"a node identity needs a node id of letters, digits, '.', '_' or '-' "
                                 f"(at most 63, starting with a letter or digit), got {self.node_id!r}")
        elif self.kind not in SINGLE_KINDS:
            raise ValueError(f"unknown identity {self.kind!r}: one of {', '.join(SINGLE_KINDS)} or node:<id>")
        elif self.node_id:
            raise ValueError(f"identity {self.kind!r} takes no node id")

    @classmethod
    def parse(cls, text: str) -> Identity:
        """``router``, ``block-service``, ``admin``, ``etcd`` or ``node:<id>``; ValueError, one line."""
        kind, sep, node_id = text.strip().partition(":")
        if sep and kind != NODE:
            raise ValueError(f"unknown identity {text!r}: one of {', '.join(SINGLE_KINDS)} or node:<id>")
        if kind == NODE and not sep:
            raise ValueError(f"a node identity is node:<id>, got {text!r}")
        return cls(kind, node_id)

    @classmethod
    def node(cls, node_id: str) -> Identity:
        return cls(NODE, node_id)

    def __str__(self) -> str:
        return f"{NODE}:{self.node_id}" if self.kind == NODE else self.kind

    @property
    def host_name(self) -> str:
        """The DNS name its certificate carries and its clients ask for (``node-0.node.kvfleet``)."""
        return f"{self.node_id}.{NODE}.{DOMAIN}" if self.kind == NODE else f"{self.kind}.{DOMAIN}"

    @property
    def file_stem(self) -> str:
        """Its directory under a certificates directory (``node-node-0``, ``router``)."""
        return f"{NODE}-{self.node_id}" if self.kind == NODE else self.kind

    def is_node(self, node_id: str | None = None) -> bool:
        return self.kind == NODE and (node_id is None or self.node_id == node_id)


ROUTER_ID, BLOCK_SERVICE_ID, ADMIN_ID, ETCD_ID = (Identity(k) for k in SINGLE_KINDS)
