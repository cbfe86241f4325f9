"""Every command answers a person's mistake in one line and a non-zero exit, never a traceback: a
missing model directory, a taken port (checked before the model loads), etcd or block_service that
nobody answers at. Each case drives the command line as a subprocess."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.cli.model_maker import make_model
from kvfleet.cli.ports import free_port

pytestmark = pytest.mark.process  # starts processes without a tier fixture (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
TENANTS = "tenants:\n  - name: gold\n    api_key: sk-gold\n    quota_mib: 16\n    paid_level: 1\n    max_concurrent: 2\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("first-contact") / "tiny", "tiny", seed=3)


@pytest.fixture
def taken_port():
    """A port some other process (a plain socket here) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture
def tenants(tmp_path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    return path


def refused(*argv: str, tmp_path: Path, timeout: float = 120, code: int | None = None) -> str:
    """Run ``kvfleet ARGV``; assert one line on stderr, no traceback, a non-zero exit (``code`` when
    given); return the line.
    A service command whose test is about another mistake passes ``--insecure-internal``, so that the
    missing choice of internal TLS does not answer first (``test_internal_tls_choice`` tests that)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVFLEET_STATE_FILE": str(tmp_path / "cluster.json")}
    env.pop("KVFLEET_ROUTER", None)
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "--log-level", "ERROR", *argv], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=timeout)
    assert done.returncode != 0 if code is None else done.returncode == code, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_compute_missing_model(tmp_path):
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(tmp_path / "nope"),
                   tmp_path=tmp_path)
    assert line == f"kvfleet compute: model directory {tmp_path / 'nope'} does not exist"


def test_compute_taken_port_is_checked_before_the_model(tmp_path, taken_port):
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(tmp_path / "nope"),
                   "--listen", f"127.0.0.1:{taken_port}", tmp_path=tmp_path)
    assert line == f"kvfleet compute: cannot listen on 127.0.0.1:{taken_port}: the port is taken by another process"


def test_compute_unreachable_etcd(tmp_path, model):
    port = free_port()
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model),
                   "--etcd", f"http://127.0.0.1:{port}", "--dependency-timeout", "1", tmp_path=tmp_path)
    assert line.startswith(f"kvfleet compute: etcd at http://127.0.0.1:{port} is unreachable (")


def test_compute_unreachable_block_service(tmp_path, model):
    port = free_port()
    line = refused("compute", "--node-id", "n1", "--insecure-internal", "--model", str(model),
                   "--block-service", f"127.0.0.1:{port}", "--dependency-timeout", "1", tmp_path=tmp_path)
    assert line.startswith(f"kvfleet compute: block_service at 127.0.0.1:{port} is unreachable (")


def test_block_service_taken_port(tmp_path, taken_port):
    line = refused("block-service", "--insecure-internal", "--listen", f"127.0.0.1:{taken_port}",
                   "--state-dir", str(tmp_path / "state"), tmp_path=tmp_path)
    assert line == f"kvfleet block-service: cannot listen on 127.0.0.1:{taken_port}: the port is taken by another process"
    assert not (tmp_path / "state").exists()


def test_router_taken_port(tmp_path, taken_port, tenants):
    line = refused("router", "--insecure-internal", "--listen", f"127.0.0.1:{taken_port}",
                   "--etcd", f"http://127.0.0.1:{free_port()}", "--tenants", str(tenants), tmp_path=tmp_path)
    assert line == f"kvfleet router: cannot listen on 127.0.0.1:{taken_port}: the port is taken by another process"


def test_router_unreachable_etcd(tmp_path, tenants):
    port = free_port()
    line = refused("router", "--insecure-internal", "--listen", "127.0.0.1:0", "--etcd", f"http://127.0.0.1:{port}",
                   "--tenants", str(tenants), "--dependency-timeout", "1", tmp_path=tmp_path)
    assert line.startswith(f"kvfleet router: etcd at http://127.0.0.1:{port} is unreachable (")


def test_router_missing_model(tmp_path, tenants):
    line = refused("router", "--insecure-internal", "--listen", "127.0.0.1:0", "--etcd", f"http://127.0.0.1:{free_port()}",
                   "--tenants", str(tenants), "--model", str(tmp_path / "nope"), tmp_path=tmp_path)
    assert line == f"kvfleet router: {tmp_path / 'nope'} is not a model directory (no tokenizer.json)"


@pytest.mark.parametrize("mode", [["--in-process"], []], ids=["in-process", "cluster"])
def test_demo_missing_model(tmp_path, mode):
    line = refused("demo", *mode, "--model", str(tmp_path / "nope"), tmp_path=tmp_path)
    assert line == f"kvfleet demo: {tmp_path / 'nope'} is not a model directory (no config.json)"


def test_demo_in_process_unusable_model(tmp_path, model):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((model / "config.json").read_text())
    line = refused("demo", "--in-process", "--model", str(broken), tmp_path=tmp_path)
    assert line.startswith("kvfleet demo: ") and str(broken) in line


def test_up_missing_model(tmp_path):
    line = refused("up", "--model", str(tmp_path / "nope"), tmp_path=tmp_path)
    assert line == f"kvfleet up: {tmp_path / 'nope'} is not a model directory (no config.json)"


def test_generate_without_a_cluster(tmp_path):
    port = free_port()
    line = refused("generate", "--router", f"127.0.0.1:{port}", "hello", tmp_path=tmp_path)
    assert line == (f"kvfleet generate: no router answers at 127.0.0.1:{port} (start a local cluster with "
                    "`kvfleet up`, or pass --router)")


def test_compute_waiting_for_block_service_stops_on_sigterm(tmp_path, model, taken_port):
    """Something listens at the block_service address but does not answer gRPC: the node waits for
    it, and a SIGTERM (Ctrl-C) meanwhile ends the wait and the process, at once and cleanly."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = tmp_path / "node.log"
    with open(log, "w") as out:
        node = subprocess.Popen([sys.executable, "-m", "kvfleet.cli", "compute", "--node-id", "n1", "--model", str(model),
                                 "--insecure-internal", "--block-service", f"127.0.0.1:{taken_port}"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while "waiting for block_service" not in log.read_text() and time.monotonic() < deadline:
            assert node.poll() is None, log.read_text()
            time.sleep(0.2)
        assert "waiting for block_service" in log.read_text()
        node.send_signal(signal.SIGTERM)
        assert node.wait(30) == 0, log.read_text()
        assert "Traceback" not in log.read_text()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
