"""Two block_service replicas as real processes electing through a real etcd, for the tests."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from kvfleet.leader import read_leader
from kvfleet.membership import etcd_client
from kvfleet_cli.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TTL_S = 2  # shortened: a dead leader is replaced within seconds


class ReplicaProcess:
    """``kvfleet block-service --etcd ...`` on its own port and state directory; always killed."""

    def __init__(self, name: str, work: Path, etcd_url: str, *extra: str) -> None:
        self.name = name
        self.state_dir = work / f"{name}-state"
        self.log_path = work / f"{name}.log"
        self.address = f"127.0.0.1:{free_port()}"
        self.argv = [sys.executable, "-m", "kvfleet_cli.cli", "block-service", "--listen", self.address,
                     "--state-dir", str(self.state_dir), "--etcd", etcd_url, "--lease-ttl", str(TTL_S),
                     "--durability", "write", *extra]
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
