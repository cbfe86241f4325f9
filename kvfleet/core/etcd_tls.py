"""aetcd over mutual TLS: the fleet's etcd client when the cluster runs with certificates.

etcd (``--client-cert-auth``) takes the client certificate's common name, the identity
(``kvfleet.core.identity``: ``router``, ``node:node-0``, ...), as the etcd user, so no password and no
token travel; the roles ``kvfleet.cli.etcd_auth`` gives those users fence the keys. The client asks
for etcd's host name (gRPC's target name override, ``etcd.kvfleet``), so only a certificate the
cluster CA issued to etcd is trusted, whatever address etcd (each member) is reached at.

aetcd builds its channel inside ``connect`` with ``insecure_channel`` and no way to pass
credentials; ``TlsClient`` chooses only the channel, and the members and failing over between them
are ``kvfleet.core.etcd_failover``'s.
"""

from __future__ import annotations

import grpc

from kvfleet.core.etcd_endpoints import EtcdEndpoints
from kvfleet.core.etcd_failover import FailoverClient
from kvfleet.core.identity import ETCD_ID
from kvfleet.core.tls import Credentials


class TlsClient(FailoverClient):
    """A ``FailoverClient`` whose channels are mutual TLS with ``credentials``."""

    def __init__(self, endpoints: EtcdEndpoints, credentials: Credentials, timeout: float | None = None,
                 server_name: str = ETCD_ID.host_name, options: dict | None = None) -> None:
        super().__init__(endpoints, timeout=timeout, options=options)
        self.credentials = credentials
        self.server_name = server_name

    def _open_channel(self, target: str) -> grpc.aio.Channel:
        options = [*self._options.items(), ("grpc.ssl_target_name_override", self.server_name)]
        return grpc.aio.secure_channel(target, self.credentials.channel_credentials(), options=options)
