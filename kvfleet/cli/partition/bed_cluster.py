"""A kvfleet cluster in the partition bed: etcd (one member, ``etcd``, or three: ``etcd-0``..``etcd-2``,
every service given them all), two block_service replicas (``bs-a`` leads, ``bs-b``
stands by, semi-synchronous), ``node-0``/``node-1`` and the router, each in its own network namespace
(``netns.Netbed``) listening on its own address, under mutual TLS, started with ``ip netns exec``.

Every process dies with this one (``PR_SET_PDEATHSIG``) and ``stop()`` (or leaving the ``with``) kills
them all and removes the namespaces, even when a test fails. The clients (``history``) run in the root
namespace and reach every service over the bridge; a ``cut(x, "client")`` cuts them off too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvfleet.cli.cluster_certs import ClusterCerts
from kvfleet.cli.demo_tenants import DEMO_TENANTS
from kvfleet.cli.etcd_server import EtcdCluster, EtcdServer
from kvfleet.cli.local_cluster import Child, LocalCluster
from kvfleet.cli.local_nodes import local_node_settings, node_command
from kvfleet.cli.partition.netns import Netbed
from kvfleet.core import certs, parent_death, settings
from kvfleet.core.identity import BLOCK_SERVICE_ID, ETCD_ID, ROUTER_ID, Identity

NODES = ("node-0", "node-1")
REPLICAS = ("bs-a", "bs-b")
SERVICES = ("etcd", *REPLICAS, *NODES, "router")
PROBE_NODE = "probe"  # the page-table client's own node id (no compute node holds it)
# the demo tenants and ``tight``, the page-table client's: 64 blocks of its 4 KiB (history.PageTableClient),
# so that its allocations run into the quota during the faults and the checker's quota check bites
BED_TENANTS = DEMO_TENANTS + """\
  - name: tight
    api_key: sk-tight
    quota_mib: 0.25
    paid_level: 0
    max_concurrent: 4
"""
PORTS = {"etcd": 2379, "bs-a": 7100, "bs-b": 7100, "node-0": 7200, "node-1": 7200, "router": 7300}


class _BedEtcd(EtcdServer):
    """An etcd member inside the bed's namespace ``name``, on its fixed ports."""

    def __init__(self, bed: Netbed, name: str, data_dir: Path, certs_dir: Path) -> None:
        super().__init__(data_dir=data_dir, host=bed.ip[name], certs_dir=certs_dir, name=name)
        self.bed = bed
        self.client_port, self.peer_port = PORTS["etcd"], PORTS["etcd"] + 1

    def launch(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._spawn()

    def wait(self, timeout: float = 20.0) -> None:
        if not self._wait_healthy(timeout):
            raise RuntimeError(f"etcd {self.name} did not become healthy in the bed: {self._reap()[-2000:]}")

    def _spawn(self) -> None:
        peer = self.peer_url
        argv = [self.binary, "--name", self.name, "--data-dir", str(self.data_dir / "member"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.initial_cluster or f"{self.name}={peer}", "--log-level", "error",
                *self._tls_flags()]
        with open(self.data_dir / "etcd.log", "ab") as log:
            self.process = subprocess.Popen([*self.bed.exec_prefix(self.name), *parent_death.wrap(argv)],
                                            stdout=subprocess.DEVNULL, stderr=log,
                                            env=parent_death.child_env(os.environ), start_new_session=True)


class BedCluster(LocalCluster):
    """A ``LocalCluster`` whose children run in the bed's namespaces: its readiness checks, ``exited``,
    ``restart``, ``kill`` and staged ``stop`` serve here unchanged (``block_service`` is ``bs-a``,
    ``block_service_standby`` is ``bs-b``)."""

    def __init__(self, model_dir: str | Path, work_dir: Path, tenants_file: Path, lease_ttl_s: int = 3,
                 block_size: int = 16, kv_cache_memory: int = 16 << 20, etcd_members: int = 1) -> None:
        # not LocalCluster.__init__: no loopback ports, no HTTP door, no metrics; what its methods read
        self.model_dir, self.work_dir, self.tenants_file = str(model_dir), Path(work_dir), str(tenants_file)
        self.lease_ttl_s, self.standby, self.metrics, self._own_work_dir = lease_ttl_s, True, False, False
        self.node = local_node_settings(None, block_size=block_size, kv_cache_memory=kv_cache_memory,
                                        dtype="float32")
        self.env, self.log_level = dict(os.environ), "INFO"
        self.etcd_names = ("etcd",) if etcd_members == 1 else tuple(f"etcd-{i}" for i in range(etcd_members))
        self.services = (*self.etcd_names, *SERVICES[1:])  # SERVICES with etcd's members for "etcd"
        self.bed = Netbed(self.services)
        self.certs = ClusterCerts(self.work_dir / "certs")
        self.etcd: _BedEtcd | EtcdCluster | None = None
        self.block_service: Child | None = None
        self.block_service_standby: Child | None = None
        self.nodes: dict[str, Child] = {}
        self.router: Child | None = None

    def address(self, name: str) -> str:
        return f"{self.bed.ip[name]}:{PORTS['etcd' if name in self.etcd_names else name]}"

    @property
    def router_address(self) -> str:
        return self.address("router")

    @property
    def etcd_url(self) -> str:
        return self.etcd.url

    def log_tail(self, name: str, lines: int = 40) -> str:
        if name in self.etcd_names:
            member = self.work_dir / name
            return (member / "etcd.log").read_text(errors="replace")[-4000:]
        return self.child(name).log_tail(lines)

    # -- starting ---------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> BedCluster:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.bed.open()
        try:
            # etcd's certificate names its bed address (the services verify it); the rest are checked
            # against their identities' host names (kvfleet.core.rpc), wherever they listen
            certs.ensure(self.certs.directory, [ETCD_ID], hosts=[self.bed.ip[n] for n in self.etcd_names])
            self.certs.prepare([*NODES, PROBE_NODE])
            self.etcd = self._start_etcd()
            self.certs.open_etcd(self.etcd.url, [*NODES, PROBE_NODE])
            self.certs.act_as_admin()
            self.block_service = self._start_replica("bs-a", timeout)
            self.wait_leader("bs-a", timeout)
            self.block_service_standby = self._start_replica("bs-b", timeout)
            for name in NODES:
                command = node_command(self.node, self.model_dir, name, self.address(name), self.etcd.url,
                                       "etcd", None)
                self.nodes[name] = self._spawn(name, ["compute", *settings.to_argv(command),
                                                      *self.certs.args(Identity.node(name))], PORTS[name])
            self.wait_ready(list(NODES), timeout)
            self.router = self._spawn("router", [
                "router", "--listen", self.address("router"), "--etcd", self.etcd.url, "--tenants", self.tenants_file,
                "--model", self.model_dir, "--block-service", "etcd", *self.certs.args(ROUTER_ID)], PORTS["router"])
            self.wait_router(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> _BedEtcd | EtcdCluster:
        """etcd's members, started together (each waits for a quorum), healthy."""
        members = [_BedEtcd(self.bed, name, self.work_dir / name, self.certs.directory) for name in self.etcd_names]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in members) if len(members) > 1 else None
        for member in members:
            member.initial_cluster = initial
            member.launch()
        for member in members:
            member.wait()
        return members[0] if len(members) == 1 else EtcdCluster.of(members)

    def _start_replica(self, name: str, timeout: float) -> Child:
        argv = ["block-service", "--listen", self.address(name), "--tenants", self.tenants_file,
                "--state-dir", str(self.work_dir / f"{name}-state"), *self.certs.args(BLOCK_SERVICE_ID),
                "--etcd", self.etcd.url, "--sync-standby", "--lease-ttl", str(self.lease_ttl_s)]
        child = self._spawn(name, argv + (["--standby"] if name == "bs-b" else []), PORTS[name])
        self._wait_port(child, timeout)
        return child

    def _launch(self, child: Child) -> None:
        """LocalCluster's launch, inside the child's namespace."""
        command = [*self.bed.exec_prefix(child.name), sys.executable, "-m", "kvfleet.cli.cli",
                   "--log-level", self.log_level, *child.argv]
        with open(child.log_path, "ab") as log:
            child.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                             env=parent_death.child_env(self.env), start_new_session=True)

    def _wait_port(self, child: Child, timeout: float) -> None:
        host, port = self.address(child.name).split(":")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive(child)
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((host, int(port))) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{child.name} did not listen on {host}:{port} within {timeout}s:\n{child.log_tail()}")

    # -- reading the cluster ----------------------------------------------------------------------

    def leader(self) -> str | None:
        """The replica (``bs-a``/``bs-b``) etcd names the block_service leader now, None: none/unknown."""
        try:
            address = self.block_service_leader()
        except Exception:
            return None
        return next((n for n in REPLICAS if self.address(n) == address), None)

    def wait_leader(self, name: str | None = None, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for replica in (self.block_service, self.block_service_standby):
                if replica is not None:
                    self._check_alive(replica)
            leader = self.leader()
            if leader is not None and (name is None or leader == name):
                return leader
            time.sleep(0.1)
        raise TimeoutError(f"no block_service leader {name or ''} within {timeout}s (now {self.leader()})")

    def credentials(self, identity: Identity):
        from kvfleet.core.tls import Credentials

        return Credentials.load(certs.identity_dir(self.certs.directory, identity), identity)

    def admin(self):
        return self.certs.admin()

    # -- stopping ---------------------------------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> None:
        """LocalCluster's staged stop, then the bed's namespaces removed; safe after a failed start."""
        try:
            super().stop(timeout)
        finally:
            self.bed.close()
