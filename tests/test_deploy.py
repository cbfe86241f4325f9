"""The deploy files keep their promises: what dies is restarted, what is unhealthy is seen.

Read as data (pyyaml), no cluster needed: every Kubernetes container has a liveness and a readiness
probe, kvfleet's own on the gRPC health service (readiness naming the service that must be
SERVING); every long-running compose service has a restart policy, kvfleet's with a healthcheck;
and the image holds every package the services import. Schema checks (yamllint, kubernetes-validate,
``docker-compose config``) are for whoever has those tools: see deploy/.yamllint.
"""

from __future__ import annotations

import json
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


# ---- metrics: every kvfleet service serves them, Prometheus scrapes them, the dashboard reads them ----

def _flag(args: list[str], flag: str) -> str | None:
    """The value of ``--flag VALUE`` or ``--flag=VALUE`` in an argument list."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return str(args[i + 1])
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def pods() -> list[tuple[str, dict, dict]]:
    """(name, pod template metadata, container) of every kvfleet container in the manifests."""
    found = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") in WORKLOADS:
                template = doc["spec"]["template"]
                for c in template["spec"]["containers"]:
                    if kvfleet_command(c) is not None:
                        found.append((f"{path.name}:{c['name']}", template["metadata"], c))
    return found


@pytest.mark.parametrize("name,metadata,container", pods(), ids=[n for n, _, _ in pods()])
def test_every_kvfleet_pod_serves_metrics_and_says_where(name, metadata, container):
    port = _flag(container["args"], "--metrics-port")
    assert port is not None and int(port) > 0, name
    assert {"name": "metrics", "containerPort": int(port)} in container["ports"], name
    annotations = metadata.get("annotations") or {}
    assert annotations.get("prometheus.io/scrape") == "true", name
    assert annotations.get("prometheus.io/port") == port, name
    assert annotations.get("prometheus.io/path", "/metrics") == "/metrics", name


def test_prometheus_scrapes_every_kvfleet_compose_service():
    targets = {t for job in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
               for sc in job["static_configs"] for t in sc["targets"]}
    kvfleet = {name: s for name, s in compose().items()
               if s.get("image") == "kvfleet:latest" and (s.get("command") or [None])[0] in READY_SERVICE}
    assert set(kvfleet) >= {"block-service", "compute-0", "compute-1", "router"}
    for name, service in kvfleet.items():
        port = _flag(service["command"], "--metrics-port")
        assert port is not None, f"{name} serves no metrics"
        assert f"{name}:{port}" in targets, f"Prometheus does not scrape {name}:{port}"
    assert {"prometheus", "grafana"} <= set(compose())


def exported_names() -> set[str]:
    """Every sample name the services can export, from their metrics modules (no process needed)."""
    from prometheus_client import generate_latest

    from block_service import metrics as block_metrics
    from block_service.durable import DurablePageTable
    from block_service.page_table import PageTable
    from compute_service import metrics as node_metrics
    from kvfleet.allocator import AllocatorStats
    from kvfleet.metric_families import registry_of
    from router import metrics as router_metrics

    table = PageTable()
    table.register_node("n0", 8, 16, 1024)
    texts = [
        generate_latest(registry_of(block_metrics.families(block_metrics.sample(DurablePageTable(table, "x"))))),
        generate_latest(block_metrics.BlockServiceMetrics().registry),
        generate_latest(registry_of(node_metrics.families(node_metrics.NodeSample(
            node_id="n0", state="READY", block_size=16, num_in_flight=0, num_running=0, num_waiting=0,
            num_preemptions=0, generated_tokens=0, prompt_tokens_computed=0, busy_seconds=0.0,
            blocks=AllocatorStats(8, 8, 0, 0, 0, 0))))),
        generate_latest(registry_of(router_metrics.families(router_metrics.RouterSample([], {}, 0)))),
        generate_latest(router_metrics.RequestMetrics().registry),
    ]
    names = set()
    for text in texts:
        for name, kind in re.findall(r"^# TYPE (\S+) (\w+)$", text.decode(), re.MULTILINE):
            names |= {name + s for s in ("_bucket", "_count", "_sum")} if kind == "histogram" else {name}
    return names


def test_the_dashboard_reads_only_metrics_the_services_export():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "kvfleet.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"kvfleet:[a-z0-9_]+", e)}
    assert len(used) >= 20
    assert used <= exported_names(), sorted(used - exported_names())
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert all(p["datasource"]["uid"] == uid for p in dashboard["panels"] if p["type"] != "row")
