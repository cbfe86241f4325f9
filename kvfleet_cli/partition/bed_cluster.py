"""A kvfleet cluster in the partition bed: etcd, two block_service replicas (``bs-a`` leads, ``bs-b``
stands by, semi-synchronous), ``node-0``/``node-1`` and the router, each in its own network namespace
(``netns.Netbed``) listening on its own address, under mutual TLS, started with ``ip netns exec``.

Every process dies with this one (``PR_SET_PDEATHSIG``) and ``stop()`` (or leaving the ``with``) kills
them all and removes the namespaces, even when a test fails. The clients (``history``) run in the root
namespace and reach every service over the bridge; a ``cut(x, "client")`` cuts them off too.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvfleet import certs, parent_death, settings
from kvfleet.identity import ADMIN_ID, BLOCK_SERVICE_ID, ETCD_ID, ROUTER_ID, Identity
from kvfleet_cli.cluster_certs import ClusterCerts
from kvfleet_cli.etcd_server import EtcdServer
from kvfleet_cli.local_nodes import local_node_settings, node_command
from kvfleet_cli.partition.netns import Netbed

NODES = ("node-0", "node-1")
REPLICAS = ("bs-a", "bs-b")
SERVICES = ("etcd", *REPLICAS, *NODES, "router")
PROBE_NODE = "probe"  # the page-table client's own node id (no compute node holds it)
PORTS = {"etcd": 2379, "bs-a": 7100, "bs-b": 7100, "node-0": 7200, "node-1": 7200, "router": 7300}


class _BedEtcd(EtcdServer):
    """etcd inside the bed's ``etcd`` namespace, on its fixed ports."""

    def __init__(self, bed: Netbed, data_dir: Path, certs_dir: Path) -> None:
        super().__init__(data_dir=data_dir, host=bed.ip["etcd"], certs_dir=certs_dir)
        self.bed = bed

    def start(self, timeout: float = 20.0) -> EtcdServer:
        self.client_port, self.peer_port = PORTS["etcd"], PORTS["etcd"] + 1
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._spawn()
        if not self._wait_healthy(timeout):
            raise RuntimeError(f"etcd did not become healthy in the bed: {self._reap()[-2000:]}")
        return self

    def _spawn(self) -> None:
        peer = f"http://{self.host}:{self.peer_port}"
        argv = [self.binary, "--name", "bed", "--data-dir", str(self.data_dir / "member"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"bed={peer}", "--log-level", "error", *self._tls_flags()]
        with open(self.data_dir / "etcd.log", "ab") as log:
            self.process = subprocess.Popen([*self.bed.exec_prefix("etcd"), *parent_death.wrap(argv)],
                                            stdout=subprocess.DEVNULL, stderr=log,
                                            env=parent_death.child_env(os.environ), start_new_session=True)


class BedCluster:
    def __init__(self, model_dir: str | Path, work_dir: Path, tenants_file: Path, lease_ttl_s: int = 3,
                 block_size: int = 16, kv_cache_memory: int = 16 << 20) -> None:
        self.model_dir, self.work_dir, self.tenants_file = str(model_dir), Path(work_dir), tenants_file
        self.lease_ttl_s = lease_ttl_s
        self.node = local_node_settings(None, block_size=block_size, kv_cache_memory=kv_cache_memory,
                                        dtype="float32")
        self.bed = Netbed(SERVICES)
        self.certs = ClusterCerts(self.work_dir / "certs")
        self.etcd: _BedEtcd | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}

    def address(self, name: str) -> str:
        return f"{self.bed.ip[name]}:{PORTS[name]}"

    @property
    def router_address(self) -> str:
        return self.address("router")

    @property
    def etcd_url(self) -> str:
        return self.etcd.url

    def log_path(self, name: str) -> Path:
        return self.work_dir / f"{name}.log"

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.etcd.data_dir / "etcd.log" if name == "etcd" else self.log_path(name)
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- starting ---------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> BedCluster:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.bed.open()
        try:
            # etcd's certificate names its bed address (the services verify it); the rest are checked
            # against their identities' host names (kvfleet.rpc), wherever they listen
            certs.ensure(self.certs.directory, [ETCD_ID], hosts=[self.bed.ip["etcd"]])
            self.certs.prepare([*NODES, PROBE_NODE])
            self.etcd = _BedEtcd(self.bed, self.work_dir / "etcd", self.certs.directory).start()
            self.certs.open_etcd(self.etcd.url, [*NODES, PROBE_NODE])
            self.certs.act_as_admin()
            for name in REPLICAS:
                self._spawn(name, self._replica_argv(name))
                self._wait_port(name, timeout)
                if name == "bs-a":
                    self.wait_leader("bs-a", timeout)
            for name in NODES:
                command = node_command(self.node, self.model_dir, name, self.address(name), self.etcd.url,
                                       "etcd", None)
                self._spawn(name, ["compute", *settings.to_argv(command), *self.certs.args(Identity.node(name))])
            self.wait_nodes_ready(list(NODES), timeout)
            self._spawn("router", ["router", "--listen", self.address("router"), "--etcd", self.etcd.url,
                                   "--tenants", str(self.tenants_file), "--model", self.model_dir,
                                   "--block-service", "etcd", *self.certs.args(ROUTER_ID)])
            self.wait_router(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _replica_argv(self, name: str) -> list[str]:
        argv = ["block-service", "--listen", self.address(name), "--tenants", str(self.tenants_file),
                "--state-dir", str(self.work_dir / f"{name}-state"), *self.certs.args(BLOCK_SERVICE_ID),
                "--etcd", self.etcd.url, "--sync-standby", "--lease-ttl", str(self.lease_ttl_s)]
        return argv + (["--standby"] if name == "bs-b" else [])

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.argv[name] = argv
        command = [*self.bed.exec_prefix(name), sys.executable, "-m", "kvfleet_cli.cli", "--log-level", "INFO", *argv]
        with open(self.log_path(name), "ab") as log:
            self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                env=parent_death.child_env(os.environ),
                                                start_new_session=True)

    def restart(self, name: str) -> None:
        """Start the exited service ``name`` again with its command line (same address, state, log)."""
        self._spawn(name, self.argv[name])

    def exited(self) -> dict[str, int]:
        return {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    def _wait_port(self, name: str, timeout: float) -> None:
        host, port = self.address(name).split(":")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive(name)
            with socket.socket() as s:
                s.settimeout(1)
                if s.connect_ex((host, int(port))) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{name} did not listen on {self.address(name)} within {timeout}s:\n{self.log_tail(name)}")

    # -- reading the cluster ----------------------------------------------------------------------

    def leader(self) -> str | None:
        """The replica (``bs-a``/``bs-b``) etcd names the block_service leader now, None: none/unknown."""
        from kvfleet.leader import leader_address

        try:
            address = asyncio.run(leader_address(self.etcd.url, credentials=self.certs.admin()))
        except Exception:
            return None
        return next((n for n in REPLICAS if self.address(n) == address), None)

    def wait_leader(self, name: str | None = None, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for replica in REPLICAS:
                if replica in self.procs:
                    self._check_alive(replica)
            leader = self.leader()
            if leader is not None and (name is None or leader == name):
                return leader
            time.sleep(0.1)
        raise TimeoutError(f"no block_service leader {name or ''} within {timeout}s (now {self.leader()})")

    def node_states(self) -> dict[str, str]:
        from kvfleet.membership import etcd_client, list_nodes

        async def read():
            async with etcd_client(self.etcd.url, credentials=self.certs.admin()) as client:
                nodes, _ = await list_nodes(client)
            return {n: info.state.value for n, info in nodes.items()}

        return asyncio.run(read())

    def wait_nodes_ready(self, node_ids: list[str], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node_id in node_ids:
                self._check_alive(node_id)
            if all(self.node_states().get(n) == "READY" for n in node_ids):
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes {node_ids} not READY within {timeout}s: {self.node_states()}")

    def wait_router(self, timeout: float = 120.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.router_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive("router")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service="kvfleet.v1.Inference"), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"router not SERVING within {timeout}s:\n{self.log_tail('router')}")

    def admin(self):
        return self.certs.admin()

    def credentials(self, identity: Identity):
        from kvfleet.tls import Credentials

        return Credentials.load(certs.identity_dir(self.certs.directory, identity), identity)

    def admin_identity(self) -> Identity:
        return ADMIN_ID

    # -- stopping ---------------------------------------------------------------------------------

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM everything (router first, block_service last), SIGKILL what overstays, then remove
        the bed; safe after a failed start."""
        order = ["router", *NODES, *REPLICAS]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self.etcd is not None:
            self.etcd.stop()
        self.certs.stop_acting()
        self.bed.close()

    def __enter__(self) -> BedCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
