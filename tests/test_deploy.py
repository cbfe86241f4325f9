"""The deploy files keep their promises: what dies is restarted, what is unhealthy is seen.

Read as data (pyyaml), no cluster needed: every Kubernetes container has a liveness and a readiness
probe, kvfleet's own on the gRPC health service (readiness naming the service that must be
SERVING); every long-running compose service has a restart policy, kvfleet's with a healthcheck;
and the image holds every package the services import. Schema checks (yamllint, kubernetes-validate,
``docker-compose config``) are for whoever has those tools: see deploy/.yamllint.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
# the service each kvfleet container's readiness names (kvfleet_cli.cli's subcommand → gRPC service)
READY_SERVICE = {"block-service": "kvfleet.v1.BlockManager", "compute": "kvfleet.v1.Compute",
                 "router": "kvfleet.v1.Inference"}


def containers() -> list[tuple[str, dict]]:
    found = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in WORKLOADS:
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    found.append((f"{path.name}:{c['name']}", c))
    return found


def kvfleet_command(container: dict) -> str | None:
    """The kvfleet subcommand a container of the kvfleet image runs, else None."""
    if container["image"] != "kvfleet":
        return None
    return container["args"][0]


def test_the_manifests_have_containers():
    names = {name.split(":")[1] for name, _ in containers()}
    assert {"etcd", "block-service", "compute", "router"} <= names


@pytest.mark.parametrize("name,container", containers(), ids=[n for n, _ in containers()])
def test_every_container_has_liveness_and_readiness(name, container):
    assert "livenessProbe" in container and "readinessProbe" in container, name
    command = kvfleet_command(container)
    if command is None:
        return
    port = container["ports"][0]["containerPort"]
    assert container["livenessProbe"]["grpc"] == {"port": port}, name  # "": the process answers
    assert container["readinessProbe"]["grpc"] == {"port": port, "service": READY_SERVICE[command]}, name


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]


@pytest.mark.parametrize("name", sorted(compose()))
def test_every_long_running_compose_service_restarts(name):
    service = compose()[name]
    if service.get("restart") == "no":  # a one-shot step: others wait for it to complete
        assert any(
            dep.get("condition") == "service_completed_successfully"
            for other in compose().values() for dep_name, dep in (other.get("depends_on") or {}).items()
            if dep_name == name and isinstance(dep, dict)
        ), f"{name} runs once but nothing waits for it"
        return
    assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name
    command = service.get("command") or []
    if service.get("image") == "kvfleet:latest" and command and command[0] in READY_SERVICE:
        test = service["healthcheck"]["test"]
        assert test[-1] == READY_SERVICE[command[0]], name


def test_the_image_holds_every_package():
    copied = set(re.findall(r"^COPY (\S+) \./\1$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE))
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()} - {"bench", "tests"}
    assert packages <= copied, f"not in the image: {sorted(packages - copied)}"
