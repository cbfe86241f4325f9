"""The whole cluster as child processes on loopback, for ``kvfleet up``, the demo and the tests.

    etcd (EtcdServer, or EtcdCluster's members) → block_service → N × ``kvfleet compute`` → ``kvfleet router``

With ``block_service_standby`` there are two block_service replicas (``block_service`` and
``block_service_standby``, each with its own state directory) electing their leader in the
cluster's etcd, replicating synchronously; the nodes and the router find the leader there.

Every child gets its own log file in the work directory and dies with this process (Linux
``PR_SET_PDEATHSIG``); ``stop()`` sends SIGTERM to all (compute nodes drain), waits, then SIGKILLs
whatever is left, so no process outlives the cluster even when a test fails. ``exited()`` and
``restart(name)`` let a supervisor (``kvfleet.cli.up``) bring a dead child back on the same port
and state directory, so its peers find it where it was.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvfleet.block_service.settings import EvictionSettings
from kvfleet.cli.cluster_certs import ClusterCerts
from kvfleet.cli.cluster_summary import blocks_table
from kvfleet.cli.demo_tenants import DEMO_TENANTS
from kvfleet.cli.etcd_server import EtcdCluster, EtcdServer, start_etcd
from kvfleet.cli.local_nodes import local_node_settings, node_command
from kvfleet.cli.ports import free_port
from kvfleet.compute_service.node.settings import NodeSettings
from kvfleet.core import parent_death, settings
from kvfleet.core.identity import BLOCK_SERVICE_ID, ROUTER_ID, Identity
from kvfleet.core.roles import MIXED

MAX_UNIX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, 104 on macOS


@dataclass(slots=True)
class Child:
    """One service process. ``process`` is the current one: a restart replaces it and keeps the
    command line, the port and the log (the new process appends to it)."""

    name: str
    argv: list[str]
    log_path: Path
    port: int
    process: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class LocalCluster:
    def __init__(
        self,
        model_dir: str | Path,
        num_nodes: int = 2,
        tenants_file: str | Path | None = None,
        work_dir: str | Path | None = None,
        block_size: int | str | None = None,
        kv_cache_memory: int | None = None,
        with_block_service: bool = True,
        compute_args: tuple[str, ...] = (),
        router_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log_level: str = "INFO",
        http: bool = True,
        metrics: bool = True,
        kv_cache_dtype: str | None = None,
        dtype: str | None = None,
        block_service_standby: bool = False,
        lease_ttl_s: int = 5, etcd_members: int = 1,  # 3: a real etcd cluster (kvfleet up --etcd-members)
        node: NodeSettings | None = None,
        insecure_internal: bool = False,
        roles: dict[str, str] | None = None,  # node id -> kvfleet.core.roles (local_nodes.node_roles); else mixed
        eviction: EvictionSettings | None = None,  # block_service's eviction policy; else its default
    ):
        """Every node takes ``node`` (``kvfleet up``'s; else the local defaults) with the engine values
        given here in place of its own; ``compute_args`` follow on each node's command line and win."""
        self.node = local_node_settings(node, block_size=block_size, kv_cache_memory=kv_cache_memory,
                                        kv_cache_dtype=kv_cache_dtype, dtype=dtype)
        self.model_dir = str(Path(model_dir).resolve())
        self.num_nodes, self.roles = num_nodes, roles or {}
        self._own_work_dir = work_dir is None  # a temporary one: its state goes at stop, its logs stay
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="kvfleet-cluster-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if tenants_file is None:
            tenants_file = self.work_dir / "tenants.yaml"
            Path(tenants_file).write_text(DEMO_TENANTS)
        self.tenants_file = str(tenants_file)
        self.with_block_service, self.eviction = with_block_service, eviction or EvictionSettings()
        self.compute_args = tuple(compute_args)
        self.router_args = tuple(router_args)
        # mutual TLS between the services, under a CA of the work directory's (made on first start)
        self.certs = ClusterCerts(self.work_dir / "certs", insecure_internal)
        self.env = {**os.environ, **(env or {})}
        self.log_level = log_level
        self.http_port = free_port() if http else None  # the router's OpenAI-compatible door
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}  # child name → its Prometheus endpoint's port
        self.etcd: EtcdServer | EtcdCluster | None = None
        self.block_service: Child | None = None
        self.block_service_standby: Child | None = None
        self.standby = block_service_standby
        self.lease_ttl_s, self.etcd_members = lease_ttl_s, etcd_members
        self.nodes: dict[str, Child] = {}
        self.router: Child | None = None
        socket_path = self.work_dir / "router.sock"
        self._router_socket = str(socket_path) if len(str(socket_path)) <= MAX_UNIX_SOCKET_PATH else None

    @property
    def block_size(self) -> int:
        return self.node.engine.block_size

    # -- addresses --------------------------------------------------------------------------------

    @property
    def router_address(self) -> str:
        return f"127.0.0.1:{self.router.port}"

    @property
    def router_unix_address(self) -> str | None:
        """The router's Unix domain socket, for clients on this machine (``unix:PATH``); None when
        the work directory's path is too long for one."""
        return f"unix:{self._router_socket}" if self._router_socket else None

    @property
    def http_url(self) -> str | None:
        """The router's OpenAI-compatible HTTP door (``.../v1``), None when not opened."""
        return f"http://127.0.0.1:{self.http_port}/v1" if self.http_port else None

    @property
    def metrics_urls(self) -> dict[str, str]:
        """Each service's Prometheus endpoint, by child name (empty when metrics are off)."""
        return {name: f"http://127.0.0.1:{port}/metrics" for name, port in self.metrics_ports.items()}

    def _metrics_port(self, name: str) -> int | None:
        """A metrics port picked now, so that a restart serves it where it was (None: no metrics)."""
        if self.metrics:
            self.metrics_ports[name] = free_port()
        return self.metrics_ports.get(name)

    def _metrics_args(self, name: str) -> list[str]:
        port = self._metrics_port(name)
        return [] if port is None else ["--metrics-port", str(port)]

    @property
    def block_service_address(self) -> str | None:
        """Where block_service answers writes: the leader etcd names now, with a standby."""
        if self.block_service is None:
            return None
        if self.standby:
            return self.block_service_leader()
        return f"127.0.0.1:{self.block_service.port}"

    def block_service_leader(self) -> str | None:
        """The replica etcd names the block_service leader now (None: none is elected)."""
        from kvfleet.core.leader import leader_address

        return asyncio.run(leader_address(self.etcd.url, credentials=self.certs.admin()))

    def _block_service_flag(self) -> list[str]:
        """What the nodes and the router are told: the fixed address, or the leader in etcd."""
        if self.block_service is None:
            return []
        return ["--block-service", "etcd" if self.standby else f"127.0.0.1:{self.block_service.port}"]

    def _spawn_block_service(self, name: str, state: str, *extra: str) -> Child:
        port = free_port()
        argv = ["block-service", "--listen", f"127.0.0.1:{port}", "--tenants", self.tenants_file,
                "--state-dir", str(self.work_dir / state), *self._metrics_args(name),
                *self.certs.args(BLOCK_SERVICE_ID), *settings.to_argv(self.eviction)]
        if self.standby:
            argv += ["--etcd", self.etcd.url, "--sync-standby", "--lease-ttl", str(self.lease_ttl_s), *extra]
        return self._spawn(name, argv, port)

    # -- processes --------------------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str], port: int) -> Child:
        child = Child(name, argv, self.work_dir / f"{name}.log", port)
        self._launch(child)
        return child

    def _launch(self, child: Child) -> None:
        with open(child.log_path, "ab") as log:
            child.process = subprocess.Popen(
                [sys.executable, "-m", "kvfleet.cli.cli", "--log-level", self.log_level, *child.argv],
                stdout=log, stderr=subprocess.STDOUT, env=parent_death.child_env(self.env),
                start_new_session=True,  # Ctrl-C reaches `kvfleet up` only; it stops them in order
            )

    def exited(self) -> dict[str, int]:
        """Name → exit code of every process of the cluster that has exited, etcd included."""
        dead = {c.name: c.process.returncode for c in self.children() if not c.alive()}
        if self.etcd is not None and self.etcd.process is not None and self.etcd.process.poll() is not None:
            dead["etcd"] = self.etcd.process.returncode
        return dead

    def child(self, name: str) -> Child:
        """The service process ``name``: ``block_service``, ``router`` or a node id."""
        child = next((c for c in self.children() if c.name == name), None)
        if child is None:
            raise KeyError(f"no process named {name!r} in this cluster")
        return child

    def restart(self, name: str) -> None:
        """Start the exited process ``name`` (``etcd``, ``block_service``, ``router`` or a node id)
        again with the same command line: same port, same state or data directory, same log. Does
        not wait for it to be ready: its peers reconnect on their own."""
        if name == "etcd":
            self.etcd.restart()
            return
        child = self.child(name)
        if child.alive():
            raise RuntimeError(f"{name} is still running (pid {child.process.pid})")
        self._launch(child)

    def start(self, timeout: float = 120.0) -> LocalCluster:
        try:
            node_ids = [f"node-{i}" for i in range(self.num_nodes)]
            self.certs.prepare(node_ids)
            self.etcd = start_etcd(self.etcd_members, self.work_dir / "etcd", self.certs.root)
            self.certs.open_etcd(self.etcd.url, node_ids)  # each identity its etcd user; auth on
            self.certs.act_as_admin()  # this process's own calls to the services (stats, etcd reads)
            if self.with_block_service:
                self.block_service = self._spawn_block_service("block_service", "block_state")
                self._wait_port(self.block_service, timeout)
                if self.standby:  # the first one leads; the standby follows it from the start
                    self.block_service_standby = self._spawn_block_service(
                        "block_service_standby", "block_state_standby", "--standby")
                    self._wait_port(self.block_service_standby, timeout)
            for i in range(self.num_nodes):
                self.add_node(f"node-{i}", wait=False)
            self.wait_ready(list(self.nodes), timeout)
            port = free_port()
            argv = ["router", "--listen", f"127.0.0.1:{port}", "--etcd", self.etcd.url,
                    "--tenants", self.tenants_file, "--model", self.model_dir, *self._metrics_args("router"),
                    *self.certs.args(ROUTER_ID), *self.router_args]
            argv += self._block_service_flag()
            if self._router_socket:
                argv += ["--listen-unix", self._router_socket]
            if self.http_port:
                argv += ["--http-listen", f"127.0.0.1:{self.http_port}"]
            self.router = self._spawn("router", argv, port)
            self.wait_router(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def add_node(self, node_id: str, wait: bool = True, timeout: float = 120.0, extra: tuple[str, ...] = ()) -> Child:
        port = free_port()
        if node_id not in self.nodes and self.nodes:  # a node added to a running cluster: its etcd user
            self.certs.open_etcd(self.etcd.url, [node_id])
        block_service = self._block_service_flag()
        command = node_command(self.node, self.model_dir, node_id, f"127.0.0.1:{port}", self.etcd.url,
                               block_service[1] if block_service else None, self._metrics_port(node_id),
                               self.roles.get(node_id, MIXED))
        argv = ["compute", *settings.to_argv(command), *self.certs.args(Identity.node(node_id)), *self.compute_args,
                *extra]
        child = self.nodes[node_id] = self._spawn(node_id, argv, port)
        if wait:
            self.wait_ready([node_id], timeout)
        return child

    def kill_node(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        self.kill(self.nodes[node_id].name, sig)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process ``name``; after SIGKILL, wait until it is gone."""
        child = self.child(name)
        child.process.send_signal(sig)
        if sig == signal.SIGKILL:
            child.process.wait()

    # -- readiness --------------------------------------------------------------------------------

    def _check_alive(self, child: Child) -> None:
        if not child.alive():
            raise RuntimeError(f"{child.name} exited with {child.process.returncode}:\n{child.log_tail()}")

    def _wait_port(self, child: Child, timeout: float) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive(child)
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", child.port)) == 0:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"{child.name} did not listen on {child.port} within {timeout}s:\n{child.log_tail()}")

    def node_states(self) -> dict[str, str]:
        """Node id → state, as etcd lists them now."""
        from kvfleet.core.membership import etcd_client, list_nodes

        async def read():
            async with etcd_client(self.etcd.url, credentials=self.certs.admin()) as client:
                nodes, _ = await list_nodes(client)
            return {n: info.state.value for n, info in nodes.items()}

        return asyncio.run(read())

    def wait_ready(self, node_ids: list[str], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node_id in node_ids:
                self._check_alive(self.nodes[node_id])
            states = self.node_states()
            if all(states.get(n) == "READY" for n in node_ids):
                return
            time.sleep(0.2)
        raise TimeoutError(f"nodes {node_ids} not READY within {timeout}s: {self.node_states()}")

    def wait_router(self, timeout: float = 120.0) -> None:
        """Until the router says it can route (``kvfleet.v1.Inference`` SERVING: a node is READY)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.router_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                self._check_alive(self.router)
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service="kvfleet.v1.Inference"), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"router not SERVING within {timeout}s:\n{self.router.log_tail()}")

    def summary(self, settle_s: float = 5.0) -> str:
        """Blocks per node, prefix hit rate and per-tenant usage, as block_service counts them, once no
        block is in use (or after ``settle_s``: a block still held then is shown, not hidden)."""
        from kvfleet.block_service.client import BlockManagerClient

        address = self.block_service_address  # with a standby: read from etcd, outside the loop below

        async def read():
            async with BlockManagerClient(address, timeout_s=10, credentials=self.certs.admin()) as client:
                return await client.stats()

        deadline = time.monotonic() + settle_s
        nodes, tenants = asyncio.run(read())
        # the last releases reach block_service just after the last token: wait for them, not for a guess
        while any(n.num_used for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.05)
            nodes, tenants = asyncio.run(read())
        return blocks_table(nodes, tenants)

    # -- teardown ---------------------------------------------------------------------------------

    def children(self) -> list[Child]:
        # Stop order: the router first (no new work), then the nodes (they drain), block_service last.
        return [c for c in [self.router, *self.nodes.values(), self.block_service, self.block_service_standby]
                if c is not None]

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM in stages (router, then nodes, then block_service), SIGKILL what overstays."""
        stages = [[self.router], list(self.nodes.values()), [self.block_service, self.block_service_standby]]
        for stage in stages:
            children = [c for c in stage if c is not None]
            for child in children:
                if child.alive():
                    child.process.terminate()
            deadline = time.monotonic() + timeout
            for child in children:
                try:
                    child.process.wait(max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
        if self.etcd is not None:
            self.etcd.stop()
        self.certs.stop_acting()
        if self._own_work_dir:
            # etcd preallocates ~60 MiB of log; a temporary cluster keeps only its logs
            for state in ("etcd", "block_state", "block_state_standby"):
                shutil.rmtree(self.work_dir / state, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
