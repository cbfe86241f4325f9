"""aetcd over mutual TLS: the fleet's etcd client when the cluster runs with certificates.

etcd (``--client-cert-auth``) takes the client certificate's common name, the identity
(``kvfleet.identity``: ``router``, ``node:node-0``, ...), as the etcd user, so no password and no
token travel; the roles ``kvfleet_cli.etcd_auth`` gives those users fence the keys. The client asks
for etcd's host name (gRPC's target name override, ``etcd.kvfleet``), so only a certificate the
cluster CA issued to etcd is trusted, whatever address etcd is reached at.

aetcd builds its channel inside ``connect`` with ``insecure_channel`` and no way to pass
credentials; ``TlsClient`` overrides only that method, and everything else is aetcd's.
"""

from __future__ import annotations

import aetcd
import grpc
from aetcd import rpc, watcher

from kvfleet.identity import ETCD_ID
from kvfleet.tls import Credentials


class TlsClient(aetcd.Client):
    """An ``aetcd.Client`` whose channel is mutual TLS with ``credentials``; unconnected until
    first used (or ``async with``), as aetcd's own."""

    def __init__(self, host: str, port: int, credentials: Credentials, timeout: float | None = None,
                 server_name: str = ETCD_ID.host_name, options: dict | None = None) -> None:
        super().__init__(host=host, port=port, timeout=timeout, options=options)
        self.credentials = credentials
        self.server_name = server_name

    async def connect(self) -> None:
        """aetcd's ``connect`` with a secure channel. Nothing here awaits, so no other task can
        see it half done (aetcd's version waits for a password login)."""
        if self._connected.is_set():
            return
        options = [*self._options.items(), ("grpc.ssl_target_name_override", self.server_name)]
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self.credentials.channel_credentials(),
                                               options=options)
        self.auth_stub = rpc.AuthStub(self.channel)
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata)
        self._connected.set()
