"""The local cluster's certificates: a CA and one certificate per service under its work
directory (``certs/``), made on first start and kept (``kvfleet up`` on the same ``--work-dir``
reuses them; nothing is rotated by surprise), or plaintext by choice (``--insecure-internal``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvfleet import certs
from kvfleet.identity import ADMIN_ID, BLOCK_SERVICE_ID, ETCD_ID, ROUTER_ID, Identity
from kvfleet.tls import Credentials


class ClusterCerts:
    def __init__(self, directory: str | Path, insecure: bool = False) -> None:
        self.directory = Path(directory)
        self.insecure = insecure
        self._admin: Credentials | None = None

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

    def admin(self) -> Credentials | None:
        """The operator's credentials, for this process's calls to the services (None: plaintext)."""
        if self.insecure:
            return None
        if self._admin is None:
            self._admin = Credentials.load(certs.identity_dir(self.directory, ADMIN_ID), ADMIN_ID)
        return self._admin
