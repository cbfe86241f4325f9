"""Two block_service replicas as real processes electing through a real etcd, for the tests, under
mutual TLS: the replicas serve and follow each other's log as ``block-service``, and the test's own
calls are made as the identity that may make them (a node's as that node, reads as ``admin``)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from kvfleet.cli.ports import free_port
from kvfleet.core import certs
from kvfleet.core.identity import ADMIN_ID, BLOCK_SERVICE_ID, Identity
from kvfleet.core.leader import read_leader
from kvfleet.core.membership import etcd_client
from kvfleet.core.tls import Credentials

ROOT = Path(__file__).resolve().parents[2]
TTL_S = 2  # shortened: a dead leader is replaced within seconds
NODES = ("n0", "n1", "n9")  # the node ids the tests' calls name


def issue_certs(directory: Path) -> Path:
    """The CA and the certificates of the replicas, the operator and ``NODES`` under ``directory``."""
    certs.ensure(directory, [BLOCK_SERVICE_ID, ADMIN_ID, *map(Identity.node, NODES)])
    return directory


def credentials(certs_dir: Path, identity: Identity) -> Credentials:
    return Credentials.load(certs.identity_dir(certs_dir, identity), identity)


class ReplicaProcess:
    """``kvfleet block-service --etcd ...`` on its own port and state directory, with the
    certificate of ``certs_dir`` (``issue_certs``); always killed."""

    def __init__(self, name: str, work: Path, etcd_url: str, certs_dir: Path, *extra: str) -> None:
        self.name = name
        self.state_dir = work / f"{name}-state"
        self.log_path = work / f"{name}.log"
        self.address = f"127.0.0.1:{free_port()}"
        self.argv = [sys.executable, "-m", "kvfleet.cli.cli", "block-service", "--listen", self.address,
                     "--state-dir", str(self.state_dir), "--etcd", etcd_url, "--lease-ttl", str(TTL_S),
                     "--durability", "write", "--certs", str(certs.identity_dir(certs_dir, BLOCK_SERVICE_ID)), *extra]
        self.proc: subprocess.Popen | None = None

    def start(self) -> ReplicaProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


def leader_address(etcd_url: str) -> str | None:
    async def read():
        async with etcd_client(etcd_url) as client:
            leader, _ = await read_leader(client)
        return leader.address if leader else None

    return asyncio.run(read())


def wait_leader(etcd_url: str, address: str, processes: list[ReplicaProcess], timeout_s: float = 60.0) -> None:
    """Until etcd names ``address`` the leader (a replica that exits fails at once, with its log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in processes:
            if p.proc is not None and p.proc.poll() is not None:
                raise AssertionError(f"{p.name} exited with {p.proc.returncode}:\n{p.log_text()[-3000:]}")
        if leader_address(etcd_url) == address:
            return
        time.sleep(0.1)
    raise AssertionError(f"{address} did not become the leader within {timeout_s} s "
                         f"(leader: {leader_address(etcd_url)})")
