"""``kvfleet up`` starts the cluster, serves, restarts what dies, and on Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from cluster_helpers import request, stream, tokens_of
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.core import certs, rpc, tls
from kvfleet.core.identity import ADMIN_ID, BLOCK_SERVICE_ID, Identity


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def role_of(pid: int) -> tuple[str, int | None] | None:
    """(name as ``kvfleet up`` says it, port it listens on) of one of its children, from its command
    line: etcd, block_service, a node id, router."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return None
    flags = dict(zip(argv, argv[1:]))
    port = int(flags["--listen"].rsplit(":", 1)[1]) if "--listen" in flags else None
    if "--name" in flags and flags["--name"] == "kvfleet":
        return "etcd", None
    if "block-service" in argv:
        return "block_service", port
    if "compute" in argv:
        return flags["--node-id"], port
    if "router" in argv:
        return "router", port
    return None


def roles(up_pid: int) -> dict[str, tuple[int, int | None]]:
    """Name → (pid, port) of the live children of ``kvfleet up``."""
    found = {}
    for pid in children_of(up_pid):
        role = role_of(pid)
        if role is not None and alive(pid):
            found[role[0]] = (pid, role[1])
    return found


def health(port: int, service: str, peer: Identity | None = None, work: Path | None = None) -> int | None:
    """``service``'s health at ``port``: a public door (``peer`` None) in plaintext, an internal
    service ``peer`` as the admin of the cluster whose work directory is ``work``."""
    admin = tls.Credentials.load(certs.identity_dir(work / "certs", ADMIN_ID), ADMIN_ID) if peer else None
    with rpc.sync_channel(f"127.0.0.1:{port}", peer=peer, credentials=admin) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=2).status
        except grpc.RpcError:
            return None


def wait_for(what: str, condition, timeout: float = 120.0, every: float = 0.2):
    """The first truthy value of ``condition()``; fails the test, saying what, after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"no {what} within {timeout}s")


class Up:
    """``kvfleet up`` as a child of the test, its stdout and stderr in a file."""

    def __init__(self, model_dir: Path, tmp_path: Path, nodes: int):
        self.output = tmp_path / "up.out"
        self.env = {**os.environ, "KVFLEET_STATE_FILE": str(tmp_path / "cluster.json")}  # not the user's
        self.env.pop("KVFLEET_ROUTER", None)
        with open(self.output, "w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvfleet.cli.cli", "up", "--nodes", str(nodes), "--model", str(model_dir),
                 "--work-dir", str(tmp_path / "work")],
                stdout=out, stderr=subprocess.STDOUT, text=True, env=self.env,
                preexec_fn=_ctrl_c_as_in_a_terminal,
            )
        self.seen: set[int] = set()

    def text(self) -> str:
        return self.output.read_text(errors="replace")

    def address(self) -> str:
        def up() -> str | None:
            assert self.process.poll() is None, self.text()
            match = re.search(r"router at (\S+),", self.text())
            return match and match.group(1)
        return wait_for("router address", up)

    def children(self) -> list[int]:
        """Every child seen so far (to clean up after a failed test)."""
        self.seen.update(children_of(self.process.pid))
        return sorted(self.seen)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        for pid in self.children():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def up(model_dir, tmp_path):
    started: list[Up] = []

    def start(nodes: int) -> Up:
        started.append(Up(model_dir, tmp_path, nodes))
        return started[-1]

    try:
        yield start
    finally:
        for u in started:
            u.close()


def _ctrl_c_as_in_a_terminal() -> None:
    """Ctrl-C reaches ``kvfleet up`` in a terminal; a test run started in the background by a
    non-interactive shell (``nohup make test &``) inherits SIGINT ignored, and Python then never
    turns it into KeyboardInterrupt. The tests' SIGINT stands for a person's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# A hang bound, not a speed check: LocalCluster.stop gives each of its three SIGTERM stages (router,
# nodes, block_service) up to 20 s before SIGKILL, and etcd 10 s; on a loaded CI machine a stage may
# use its time.
STOP_BOUND_S = 3 * 20 + 10 + 30


def stop_and_check_nothing_is_left(u: Up) -> None:
    children = u.children()
    u.process.send_signal(signal.SIGINT)
    try:
        code = u.process.wait(STOP_BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"kvfleet up did not stop within {STOP_BOUND_S}s:\n{u.text()}") from None
    assert code == 0, u.text()
    assert "stopping the cluster" in u.text()
    assert wait_for("exit of every child", lambda: not [p for p in children if alive(p)], timeout=10)


def test_up_serves_and_ctrl_c_stops_everything(up):
    u = up(nodes=2)
    address = u.address()
    assert set(roles(u.process.pid)) == {"etcd", "block_service", "node-0", "node-1", "router"}
    u.children()
    chunks = stream(address, request(text="hello from kvfleet up", max_tokens=5, ignore_eos=True))
    assert len(tokens_of(chunks)) == 5
    # the OpenAI-compatible door, at the URL and with the model id that `up` prints
    url, model = re.search(r"OpenAI-compatible HTTP API at (\S+) \(model '([^']+)'\)", u.text()).groups()
    answer = openai.OpenAI(base_url=url, api_key="sk-gold", max_retries=0).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=5, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 5
    # every service's Prometheus endpoint, at the URL `up` prints for it
    urls = dict(re.findall(r"^  (\S+) +(http://\S+/metrics)$", u.text(), re.MULTILINE))
    assert set(urls) == {"block_service", "node-0", "node-1", "router"}, u.text()
    for url in urls.values():
        assert "# TYPE kvfleet:" in urllib.request.urlopen(url, timeout=30).read().decode()
    stop_and_check_nothing_is_left(u)
    assert "restarting" not in u.text()


def test_generate_finds_the_cluster_up_started(up, tmp_path):
    u = up(nodes=1)
    address = u.address()
    state = tmp_path / "cluster.json"
    assert state.is_file()
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "generate", "--max-tokens", "3", "--ignore-eos", "hi"],
                          capture_output=True, text=True, env=u.env, timeout=120)  # no --router, no --api-key
    assert done.returncode == 0, done.stderr
    assert "[length: node node-0" in done.stderr and "3 generated" in done.stderr
    stop_and_check_nothing_is_left(u)
    assert not state.exists()
    done = subprocess.run([sys.executable, "-m", "kvfleet.cli", "generate", "--router", address, "hi"],
                          capture_output=True, text=True, env=u.env, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"kvfleet generate: no router answers at {address} (start a local cluster with `kvfleet up`, "
        "or pass --router)"]


@pytest.mark.chaos
def test_up_restarts_a_killed_block_service_on_its_port(up, tmp_path):
    u = up(nodes=1)
    address = u.address()
    before = roles(u.process.pid)
    u.children()
    pid, port = before["block_service"]
    work = tmp_path / "work"
    assert health(port, "kvfleet.v1.BlockManager", BLOCK_SERVICE_ID, work) == health_pb2.HealthCheckResponse.SERVING

    os.kill(pid, signal.SIGKILL)
    wait_for("restart line", lambda: "block_service exited with code -9; restarting in 0.5 s (restart 1)" in u.text())
    pid_after, port_after = wait_for("new block_service", lambda: roles(u.process.pid).get("block_service"))
    assert pid_after != pid and port_after == port
    wait_for("block_service SERVING",
             lambda: health(port, "kvfleet.v1.BlockManager", BLOCK_SERVICE_ID, work) ==
             health_pb2.HealthCheckResponse.SERVING)

    def served() -> bool:
        try:
            chunks = stream(address, request(text="after the restart", max_tokens=5, ignore_eos=True), timeout=30)
        except grpc.RpcError:
            return False  # nodes may still be coming back
        return len(tokens_of(chunks)) == 5
    wait_for("request served after the restart", served, every=1.0)

    # Whatever else died with block_service (a node, say) was restarted too: every process is back.
    now = roles(u.process.pid)
    assert set(now) == set(before), (now, u.text())
    restarted = set(re.findall(r"(\S+) exited with code \S+; restarting in", u.text()))
    assert "block_service" in restarted and restarted <= set(before), u.text()
    assert all(now[name][1] == before[name][1] for name in now)  # same ports
    # what the Kubernetes probes ask (deploy/k8s): "" is liveness, the named service readiness
    SERVING = health_pb2.HealthCheckResponse.SERVING
    node0 = Identity.node("node-0")
    assert health(now["node-0"][1], "", node0, work) == health(now["router"][1], "") == SERVING
    assert health(now["node-0"][1], "kvfleet.v1.Compute", node0, work) == \
        health(now["router"][1], "kvfleet.v1.Inference") == SERVING
    assert "giving up" not in u.text()
    assert "restarting in 0.5 s (restart 1)" in (tmp_path / "work" / "supervisor.log").read_text()
    stop_and_check_nothing_is_left(u)


@pytest.mark.cluster
def test_a_temporary_cluster_keeps_its_logs_and_drops_its_state(model_dir):
    with LocalCluster(model_dir, num_nodes=1) as cluster:
        work = cluster.work_dir
        assert (work / "etcd").is_dir() and (work / "block_state").is_dir()
    try:
        assert not (work / "etcd").exists() and not (work / "block_state").exists()
        assert (work / "router.log").exists() and (work / "node-0.log").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)
