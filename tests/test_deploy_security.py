"""deploy/ closes the back wall: every internal connection is mutual TLS under the cluster CA, each
container holds its own identity's key and no other, and the networks carry only the architecture's
arrows. Read as data (pyyaml), with kvfleet.core.identity deciding what an identity's directory and host
name are, so the deploy files and the services cannot drift apart.

cert-manager's objects are not in the Kubernetes schema that tests/test_deploy.py validates against:
here they are checked against the part of cert-manager.io/v1 they use (a field outside it fails, so
a misspelling is not silently dropped), and for what a kvfleet certificate must say.
"""

from __future__ import annotations

import re

import pytest
import yaml

from kvfleet.core.identity import ADMIN, BLOCK_SERVICE, ETCD, ROUTER, SINGLE_KINDS, Identity
from tests.test_deploy import (
    CERT_MANAGER_API,
    COMPOSE_IMAGE,
    DEPLOY,
    HEALTH_PORT,
    IMAGE_UID,
    READY_SERVICE,
    WORKLOADS,
    _flag,
    compose,
    kvfleet_command,
    manifests,
)

INTERNAL_PORTS = {2379, 2380, 50051, 50061, 50071}  # answer only to a client certificate (or are public)
# --etcd everywhere: every member of etcd's three, the client moving to the next when one fails
COMPOSE_ETCD = ",".join(f"https://etcd-{i}:2379" for i in range(3))
K8S_ETCD = ",".join(f"https://etcd-{i}.etcd:2379" for i in range(3))  # the headless Service's pod names


def identity_of(command: list[str]) -> Identity | None:
    """Who a kvfleet command runs as; None for commands that speak to no internal service."""
    kind = {"router": ROUTER, "block-service": BLOCK_SERVICE, "etcd-auth": ADMIN}.get(command[0])
    if kind:
        return Identity(kind)
    if command[0] == "compute":
        return Identity.node(_flag(command, "--node-id"))
    return None


# ---- compose ----------------------------------------------------------------------------------

def kvfleet_services() -> dict[str, dict]:
    """The long-running kvfleet services of the compose file (router, block_service, the nodes)."""
    return {name: s for name, s in compose().items() if s.get("image") == COMPOSE_IMAGE
            and (s.get("command") or ["-"])[0] in READY_SERVICE}


def mounts(service: dict) -> dict[str, tuple[str, bool]]:
    """container path -> (source, read-only) of a compose service's volumes."""
    found = {}
    for spec in service.get("volumes") or []:
        source, path, *mode = spec.split(":")
        found[path] = (source, mode == ["ro"])
    return found


def issued() -> dict[Identity, list[str]]:
    """What the `certs` step issues: identity -> its --host names."""
    script = compose()["certs"]["command"][0]
    assert re.search(r"^kvfleet certs init /certs$", script, re.MULTILINE)
    found = {}
    for name, args in re.findall(r"^kvfleet certs issue (\S+) --dir /certs(.*)$", script, re.MULTILINE):
        found[Identity.parse(name)] = re.findall(r"--host (\S+)", args)
    return found


def test_only_the_router_and_the_uis_leave_the_internal_network():
    services = compose()
    networks = {name: set(s.get("networks") or ()) for name, s in services.items()}
    assert set(kvfleet_services()) >= {"router", "block-service", "block-service-standby", "compute-0", "compute-1"}
    outside = {"router": {"internal", "public"}, "jaeger": {"internal", "ui"}, "prometheus": {"internal", "ui"},
               "grafana": {"ui"}, "model": {"download"}, "certs": set()}
    for name, nets in networks.items():
        assert nets == outside.get(name, {"internal"}), name
    assert services["certs"]["network_mode"] == "none"
    declared = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["networks"]
    assert declared["internal"] == {"internal": True}
    assert not any((declared[n] or {}).get("internal") for n in declared if n != "internal")
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"router", "jaeger", "prometheus", "grafana"}  # each also on a network that can publish
    # HOST:CONTAINER, the host side overridable (${KVFLEET_GRPC_PORT:-50051}); the container side fixed
    assert {p.rsplit(":", 1)[1] for p in services["router"]["ports"]} == {"50051", "8000"}


def test_every_kvfleet_compose_service_runs_as_its_own_identity_and_holds_no_other_key():
    certificates = issued()
    assert set(certificates) >= {Identity(k) for k in SINGLE_KINDS}
    for name, service in {**kvfleet_services(), "etcd-auth": compose()["etcd-auth"]}.items():
        command = service["command"]
        identity = identity_of(command)
        where = f"/certs/{identity.file_stem}"
        assert _flag(command, "--certs") == where, name
        assert "--insecure-internal" not in command, name
        source, read_only = mounts(service)[where]  # certs-router, ..., certs-node-<id>
        assert source == f"certs-{identity.file_stem.removeprefix('node-')}" and read_only, name
        certs_volumes = [s for s, _ in mounts(service).values() if s.startswith("certs-")]
        assert certs_volumes == [source], f"{name} mounts another identity's key: {certs_volumes}"
        assert identity in certificates, f"{name} runs as {identity}, which `certs` never issues"
        assert _flag(command, "--etcd") == COMPOSE_ETCD, name  # every member
        advertised = _flag(command, "--advertise")  # where its peers dial it: its certificate names that host
        assert advertised is None or advertised.split(":")[0] in certificates[identity], name
    nodes = {identity_of(s["command"]).node_id for s in kvfleet_services().values() if s["command"][0] == "compute"}
    assert set(_flag(compose()["etcd-auth"]["command"], "--nodes").split(",")) == nodes
    assert not any("--insecure-internal" in (s.get("command") or []) for s in compose().values())


def test_the_certs_step_writes_each_identity_into_its_own_volume_and_the_ca_key_stays_there():
    certs = compose()["certs"]
    written = mounts(certs)
    assert written["/certs/ca"] == ("certs-ca", False)
    for identity in issued():
        assert written[f"/certs/{identity.file_stem}"][1] is False, identity
    assert len(written) == len(issued()) + 1
    assert "etcd" in issued()[Identity(ETCD)]  # what etcdctl and the URLs name
    assert certs["restart"] == "no" and certs["user"] == "0:0"
    every_dir = {f"/certs/{i.file_stem}" for i in issued()}
    script = certs["command"][0].replace("\\\n", " ")  # a line continued
    assert set(re.search(rf"chown -R {IMAGE_UID}:{IMAGE_UID} (.*)$", script, re.MULTILINE).group(1).split()) \
        == every_dir  # every service runs as the image's user, etcd included (the image's etcd)
    for name, service in compose().items():
        if name != "certs":
            assert not any(source == "certs-ca" for source, _ in mounts(service).values()), name


@pytest.mark.parametrize("name", ["etcd-0", "etcd-1", "etcd-2"])
def test_compose_etcd_asks_every_client_and_peer_for_a_certificate(name):
    etcd = compose()[name]
    flags = {arg.split("=")[0]: arg.split("=", 1)[-1] for arg in etcd["command"][1:]}
    assert flags["--listen-client-urls"].startswith("https://") and "--client-cert-auth" in flags
    assert flags["--listen-peer-urls"].startswith("https://") and "--peer-client-cert-auth" in flags
    assert {flags[f] for f in ("--cert-file", "--peer-cert-file")} == {"/certs/etcd/tls.crt"}
    assert {flags[f] for f in ("--trusted-ca-file", "--peer-trusted-ca-file")} == {"/certs/etcd/ca.crt"}
    assert f"{name}=https://{name}:2380" in flags["--initial-cluster"].split(",")
    assert etcd["environment"]["ETCD_NAME"] == name
    assert etcd["environment"]["ETCD_ADVERTISE_CLIENT_URLS"] == f"https://{name}:2379"
    assert f"https://{name}:2379" in COMPOSE_ETCD.split(",")
    assert name in issued()[Identity(ETCD)]  # its peers and clients check its name
    assert mounts(etcd)["/certs/etcd"] == ("certs-etcd", True)
    assert [s for s, _ in mounts(etcd).values() if s.startswith("certs-")] == ["certs-etcd"]
    test = etcd["healthcheck"]["test"]
    assert "--endpoints=https://localhost:2379" in test and "--cert=/certs/etcd/tls.crt" in test


@pytest.mark.parametrize("name", sorted(kvfleet_services()))
def test_compose_healthchecks_ask_the_plaintext_health_port(name):
    service = compose()[name]
    assert _flag(service["command"], "--health-port") == str(HEALTH_PORT), name
    assert service["healthcheck"]["test"][-2:] == [f"localhost:{HEALTH_PORT}", READY_SERVICE[service["command"][0]]]


# ---- Kubernetes: certificates -----------------------------------------------------------------

# the part of cert-manager.io/v1 these manifests use; [x]: a list of x; a dict: an object of those fields
ISSUER_REF = {"name": str, "kind": str, "group": str}
CERTIFICATE = {"secretName": str, "commonName": str, "dnsNames": [str], "ipAddresses": [str], "usages": [str],
               "duration": str, "renewBefore": str, "isCA": bool, "subject": {"organizations": [str]},
               "privateKey": {"algorithm": str, "size": int, "encoding": str, "rotationPolicy": str},
               "issuerRef": ISSUER_REF}
ISSUER = {"selfSigned": {}, "ca": {"secretName": str}}
REQUIRED = {"Certificate": {"secretName", "issuerRef"}, "Issuer": set()}
KEY_USAGES = {"signing", "digital signature", "content commitment", "key encipherment", "key agreement",
              "data encipherment", "cert sign", "crl sign", "encipher only", "decipher only", "any", "server auth",
              "client auth", "code signing", "email protection", "s/mime", "ipsec end system", "ipsec tunnel",
              "ipsec user", "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"}
DURATION = re.compile(r"(\d+h)?(\d+m)?(\d+s)?")


def shape_errors(value, shape, path: str) -> list[str]:
    if isinstance(shape, dict):
        if not isinstance(value, dict):
            return [f"{path}: an object expected"]
        unknown = [f"{path}.{k}: not a field this test knows of cert-manager.io/v1" for k in value if k not in shape]
        return unknown + [e for k, v in value.items() if k in shape for e in shape_errors(v, shape[k], f"{path}.{k}")]
    if isinstance(shape, list):
        if not isinstance(value, list):
            return [f"{path}: a list expected"]
        return [e for i, v in enumerate(value) for e in shape_errors(v, shape[0], f"{path}[{i}]")]
    return [] if isinstance(value, shape) else [f"{path}: {shape.__name__} expected, got {value!r}"]


def cert_manager_objects(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d["apiVersion"] == CERT_MANAGER_API and d["kind"] == kind}


def test_the_cert_manager_objects_are_well_formed_and_chain_to_one_ca():
    issuers, certificates = cert_manager_objects("Issuer"), cert_manager_objects("Certificate")
    kinds = {d["kind"] for d in manifests() if d["apiVersion"] == CERT_MANAGER_API}
    assert kinds == {"Issuer", "Certificate"}
    for name, doc in {**issuers, **certificates}.items():
        spec = doc["spec"]
        assert not shape_errors(spec, CERTIFICATE if doc["kind"] == "Certificate" else ISSUER, name)
        assert REQUIRED[doc["kind"]] <= spec.keys(), name
        if doc["kind"] == "Issuer":
            assert len(spec) == 1, f"{name}: an Issuer is exactly one kind"
            continue
        assert spec["issuerRef"]["name"] in issuers and spec["issuerRef"].get("kind", "Issuer") == "Issuer", name
        assert spec.get("privateKey", {}).get("algorithm") == "ECDSA" and spec["privateKey"]["size"] == 256, name
        assert spec["privateKey"].get("encoding", "PKCS1") == "PKCS8", name  # what `kvfleet certs` writes
        assert set(spec.get("usages", [])) <= KEY_USAGES, name
        assert all(DURATION.fullmatch(spec[k]) for k in ("duration", "renewBefore") if k in spec), name
    assert len({c["spec"]["secretName"] for c in certificates.values()}) == len(certificates)
    [ca] = [c for c in certificates.values() if c["spec"].get("isCA")]
    assert "selfSigned" in issuers[ca["spec"]["issuerRef"]["name"]]["spec"]
    [ca_issuer] = [i for i in issuers.values() if i["spec"].get("ca", {}).get("secretName") == ca["spec"]["secretName"]]
    for cert in certificates.values():
        if cert is not ca:
            assert cert["spec"]["issuerRef"]["name"] == ca_issuer["metadata"]["name"], cert["metadata"]["name"]


def identity_certificates() -> dict[Identity, dict]:
    """Identity -> its Certificate's spec (every one but the CA's)."""
    return {Identity.parse(c["spec"]["commonName"]): c["spec"]
            for c in cert_manager_objects("Certificate").values() if not c["spec"].get("isCA")}


def test_every_single_identity_has_a_certificate_for_both_ends_of_a_connection():
    certificates = identity_certificates()
    assert set(certificates) == {Identity(k) for k in SINGLE_KINDS}
    for identity, spec in certificates.items():
        assert identity.host_name in spec["dnsNames"], identity  # what kvfleet's clients ask for
        assert {"server auth", "client auth", "digital signature"} <= set(spec["usages"]), identity
    etcd = certificates[Identity(ETCD)]["dnsNames"]
    assert {f"etcd-{i}.etcd" for i in range(3)} <= set(etcd)  # its peers' names, each its own


def workload_pods() -> list[tuple[str, dict]]:
    """(kind/name, pod spec) of every workload and Job."""
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"])
            for d in manifests() if d["kind"] in (*WORKLOADS, "Job")]


def certs_volume(spec: dict, container: dict) -> dict:
    """The volume mounted, read-only, at the directory the container's --certs names."""
    where = _flag(container["args"], "--certs")
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == where]
    assert mount.get("readOnly") is True, where
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    return volume


def test_every_kvfleet_workload_mounts_its_identity_and_passes_certs():
    certificates = {s["secretName"]: i for i, s in identity_certificates().items()}
    seen = set()
    for name, template in workload_pods():
        spec = template["spec"]
        for container in spec["containers"]:
            if kvfleet_command(container) is None:
                continue
            args = container["args"]
            assert "--insecure-internal" not in args and _flag(args, "--etcd") == K8S_ETCD, name
            volume = certs_volume(spec, container)
            if args[0] == "compute":  # a certificate per pod, named after it (compute.yaml says why)
                attributes = volume["csi"]["volumeAttributes"]
                assert volume["csi"]["driver"] == "csi.cert-manager.io" and volume["csi"]["readOnly"] is True
                assert _flag(args, "--node-id") == "$(POD_NAME)"
                assert attributes["csi.cert-manager.io/common-name"] == "node:${POD_NAME}"
                assert "${POD_NAME}.node.kvfleet" in attributes["csi.cert-manager.io/dns-names"].split(",")
                assert attributes["csi.cert-manager.io/issuer-name"] == "kvfleet-ca"
                assert (attributes["csi.cert-manager.io/key-algorithm"], attributes["csi.cert-manager.io/key-size"],
                        attributes["csi.cert-manager.io/key-encoding"]) == ("ECDSA", "256", "PKCS8")
                assert {"server auth", "client auth"} <= set(attributes["csi.cert-manager.io/key-usages"].split(","))
                seen.add("node")
                continue
            identity = certificates[volume["secret"]["secretName"]]
            assert identity == identity_of(args), f"{name} runs {args[0]} with {identity}'s certificate"
            assert _flag(args, "--certs") == f"/certs/{identity.file_stem}", name
            seen.add(str(identity))
    assert seen == {"router", "block-service", "admin", "node"}


def test_kubernetes_etcd_asks_clients_and_peers_for_certificates():
    [etcd] = [d for d in manifests() if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "etcd"]
    spec = etcd["spec"]["template"]["spec"]
    [container] = spec["containers"]
    flags = {arg.split("=")[0]: arg.split("=", 1)[-1] for arg in container["command"][1:]}
    assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
    assert all(flags[f].startswith("https://") for f in ("--listen-client-urls", "--listen-peer-urls"))
    assert all(url.split("=")[1].startswith("https://") for url in flags["--initial-cluster"].split(","))
    [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == "/certs/etcd"]
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert identity_certificates()[Identity(ETCD)]["secretName"] == volume["secret"]["secretName"]
    assert {flags[f] for f in ("--cert-file", "--peer-cert-file")} == {"/certs/etcd/tls.crt"}
    assert {flags[f] for f in ("--trusted-ca-file", "--peer-trusted-ca-file")} == {"/certs/etcd/ca.crt"}


def test_every_probe_targets_a_plaintext_health_port():
    for name, template in workload_pods():
        for container in template["spec"]["containers"]:
            probes = [container[p] for p in ("startupProbe", "livenessProbe", "readinessProbe") if p in container]
            ports = {(p.get("grpc") or p.get("httpGet") or p.get("tcpSocket"))["port"] for p in probes}
            assert not ports & INTERNAL_PORTS, f"{name}: a probe holds no client certificate"
            if kvfleet_command(container) in READY_SERVICE:
                assert ports == {HEALTH_PORT} and all("grpc" in p for p in probes), name
            if container["name"] == "etcd":
                metrics = next(a for a in container["command"] if a.startswith("--listen-metrics-urls="))
                assert metrics.startswith("--listen-metrics-urls=http://") and ports == {int(metrics.rsplit(":", 1)[1])}


# ---- Kubernetes: closed networks --------------------------------------------------------------

# (from, to, port): "*" is anyone, "ns:NAME" another namespace; anything else a pod's app label here
ARROWS = {("*", "router", 50051), ("*", "router", 8000),
          ("router", "compute", 50071), ("compute", "compute", 50071),
          ("router", "block-service", 50061), ("compute", "block-service", 50061),
          ("block-service", "block-service", 50061),
          *((app, "etcd", 2379) for app in ("router", "compute", "block-service", "etcd-auth")),
          ("etcd", "etcd", 2380),
          *((app, "otel-collector", 4317) for app in ("router", "compute", "block-service")),
          ("otel-collector", "jaeger", 4317),
          *(("ns:monitoring", app, 9400) for app in ("router", "compute", "block-service"))}


def selects(selector: dict, labels: dict) -> bool:
    for expression in selector.get("matchExpressions", []):
        assert expression["operator"] == "In", expression  # the only operator read here
        if labels.get(expression["key"]) not in expression["values"]:
            return False
    return selector.get("matchLabels", {}).items() <= labels.items()


def sources(rule: dict, apps: dict[str, dict]) -> set[str]:
    """Who an ingress rule admits, in ARROWS' terms."""
    if "from" not in rule:
        return {"*"}
    found = set()
    for peer in rule["from"]:
        if "namespaceSelector" in peer:
            assert "podSelector" not in peer and "ipBlock" not in peer, peer
            found.add(f"ns:{peer['namespaceSelector']['matchLabels']['kubernetes.io/metadata.name']}")
        else:
            found |= {app for app, labels in apps.items() if selects(peer["podSelector"], labels)}
    return found


def policies() -> list[dict]:
    return [d for d in manifests() if d["kind"] == "NetworkPolicy"]


def test_a_default_deny_and_a_policy_for_every_pod_that_listens():
    deny = [p for p in policies() if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]]
    assert deny and deny[0]["spec"]["policyTypes"] == ["Ingress"]
    for name, template in workload_pods():
        labels = template["metadata"]["labels"]
        allowed = [p for p in policies() if p not in deny and selects(p["spec"]["podSelector"], labels)]
        assert allowed or labels["app"] == "etcd-auth", f"{name}: no policy admits anything"  # the Job serves nothing


def test_the_network_policies_allow_exactly_the_architectures_arrows():
    apps = {template["metadata"]["labels"]["app"]: template["metadata"]["labels"] for _, template in workload_pods()}
    allowed = set()
    for policy in policies():
        targets = [app for app, labels in apps.items() if selects(policy["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"], policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            ports = [p["port"] for p in rule["ports"]]
            allowed |= {(src, dst, port) for src in sources(rule, apps) for dst in targets for port in ports}
    assert allowed == ARROWS, {"extra": allowed - ARROWS, "missing": ARROWS - allowed}
    assert not {port for _, _, port in allowed} & {HEALTH_PORT, 2381}  # the kubelet's, from the pod's machine

