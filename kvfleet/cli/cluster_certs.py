"""The local cluster's certificates: a CA and one certificate per service under its work
directory (``certs/``), made on first start and kept (``kvfleet up`` on the same ``--work-dir``
reuses them; nothing is rotated by surprise), or plaintext by choice (``--insecure-internal``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvfleet.core import certs
from kvfleet.core.identity import ADMIN_ID, BLOCK_SERVICE_ID, ETCD_ID, ROUTER_ID, Identity
from kvfleet.core.tls import Credentials


class ClusterCerts:
    def __init__(self, directory: str | Path, insecure: bool = False) -> None:
        self.directory = Path(directory)
        self.insecure = insecure
        self._admin: Credentials | None = None
        self._before: Credentials | None = None

    @property
    def root(self) -> Path | None:
        """The certificates directory (None: plaintext)."""
        return None if self.insecure else self.directory

    def prepare(self, node_ids: Iterable[str] = ()) -> list[Identity]:
        """The CA and every service's certificate, made where missing; the identities made now."""
        if self.insecure:
            return []
        services = [ROUTER_ID, BLOCK_SERVICE_ID, ADMIN_ID, ETCD_ID, *(Identity.node(n) for n in node_ids)]
        return certs.ensure(self.directory, services)

    def args(self, identity: Identity) -> list[str]:
        """The flags that give a service its certificate (made now if missing), or plaintext."""
        if self.insecure:
            return ["--insecure-internal"]
        certs.ensure(self.directory, [identity])
        return ["--certs", str(certs.identity_dir(self.directory, identity))]

    def open_etcd(self, url: str, node_ids: Iterable[str]) -> None:
        """Give the services (and ``node_ids``) their etcd users and roles and turn etcd's
        authentication on (``kvfleet.cli.etcd_auth``); nothing in plaintext."""
        if self.insecure:
            return
        from kvfleet.cli import etcd_auth

        node_ids = list(node_ids)
        for node_id in node_ids:
            certs.ensure(self.directory, [Identity.node(node_id)])
        etcd_auth.enable(url, self.admin(), node_ids)

    def channel(self, address: str, peer: Identity):
        """An asyncio channel to the cluster's service ``peer`` at ``address``, as admin."""
        from kvfleet.core import rpc

        return rpc.channel(address, peer=peer, credentials=self.admin())

    def sync_channel(self, address: str, peer: Identity):
        """The same, synchronous."""
        from kvfleet.core import rpc

        return rpc.sync_channel(address, peer=peer, credentials=self.admin())

    def act_as_admin(self) -> None:
        """This process calls the services as admin from now on (``kvfleet.core.tls.use``)."""
        from kvfleet.core import tls

        self._before = tls.current()  # another cluster's, still running (a test's shared one)
        tls.use(self.admin())

    def stop_acting(self) -> None:
        """Back to the credentials in use before, unless another cluster's are in use by now."""
        from kvfleet.core import tls

        if tls.current() is self.admin():
            tls.use(self._before)

    def admin(self) -> Credentials | None:
        """The operator's credentials, for this process's calls to the services (None: plaintext)."""
        if self.insecure:
            return None
        if self._admin is None:
            self._admin = Credentials.load(certs.identity_dir(self.directory, ADMIN_ID), ADMIN_ID)
        return self._admin


def add_admin_flag(parser) -> None:
    """``--certs`` of an operator's command (``kvfleet blocks``): the admin identity's directory."""
    parser.add_argument("--certs", default=None, metavar="DIR",
                        help="the admin certificate directory for a cluster under mutual TLS (default: the local "
                             "cluster's, when `kvfleet up` runs one; none: plaintext)")


def use_admin(explicit: str | None, state_certs: str | None) -> Credentials | None:
    """Make this process the operator: ``--certs`` (else the local cluster's admin directory)
    for every internal call it makes; None when neither is known (plaintext). ``ValueError``
    (one line) for a directory that does not hold admin's certificate."""
    from kvfleet.core import tls

    directory = explicit or (str(certs.identity_dir(state_certs, ADMIN_ID)) if state_certs else None)
    credentials = Credentials.load(directory, ADMIN_ID) if directory else None
    tls.use(credentials)
    return credentials
