"""``make deploy-check``: the compose cluster of deploy/ as a user meets it, end to end, on this machine.

Builds the image twice (cold: ``--no-cache``; warm: again, every layer cached), brings the core cluster
up from fresh volumes and waits until every service is healthy by its gRPC health check, asks a chat
question through the official ``openai`` client (the HTTP door) and through gRPC ``Generate``
(``kvfleet generate``), kills a compute container's process (a crash: compose's restart policy brings
it back) and then the block_service leader's (the standby takes over), asking again after each,
restarts the whole cluster (every container killed at once, as by a host losing power, and removed;
the volumes kept), block_service first and alone, whose page table (the nodes' pools, the blocks the
asks left cached) and tenants' charges must come back from its volume as they were, then the rest,
and brings it down with nothing left running. Steps are told on stderr; the last line on stdout is
one JSON object.

Its own compose project (``kvfleet-check``): a cluster a user runs from deploy/ (project ``deploy``) is
not touched, but the router's host ports must be free (KVFLEET_GRPC_PORT, KVFLEET_HTTP_PORT).
``DEPLOY_CHECK_COLD=0`` skips the cold build (``build_s_cold``: null).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "kvfleet-check"
COMPOSE = ["docker-compose", "-p", PROJECT, "-f", str(ROOT / "deploy" / "docker-compose.yml")]
ETCD = ("etcd-0", "etcd-1", "etcd-2")  # one etcd cluster of three members
ETCD_ENDPOINTS = ",".join(f"https://{member}:2379" for member in ETCD)
CORE = (*ETCD, "block-service", "block-service-standby", "compute-0", "compute-1", "router")
BLOCK_SERVICES = ("block-service", "block-service-standby")
API_KEY = "sk-gold-change-me"  # deploy/tenants.yaml
QUESTION = "What is the capital of France?"
MAX_TOKENS = 24
ADMIN = ["--certs", "/certs/admin"]  # the operator's identity, mounted in the one-off etcd-auth container
HEALTHY_TIMEOUT_S = 1200.0


class CheckError(Exception):
    """A step that failed; one line."""


def say(text: str) -> None:
    print(f"deploy-check: {text}", file=sys.stderr, flush=True)


def run(cmd: list[str], timeout: float = 600, check: bool = True, env: dict | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise CheckError(f"{' '.join(cmd[:4])} ... exited {done.returncode}: {last}")
    return done.stdout


def pip_cert() -> str:
    """The certificate the host's pip trusts (as deploy/image.sh finds it), for the `model` step's pip."""
    if os.environ.get("PIP_CERT"):
        return os.environ["PIP_CERT"]
    listed = run([sys.executable, "-m", "pip", "config", "list"], check=False)
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".cert"):
            return value.strip("'\"")
    return ""


def compose_env() -> dict:
    env = dict(os.environ)
    env.setdefault("KVFLEET_PIP_CERT", pip_cert() or "/dev/null")
    return env


ENV = compose_env()
HTTP_PORT = int(ENV.get("KVFLEET_HTTP_PORT", "8000"))
GRPC_PORT = int(ENV.get("KVFLEET_GRPC_PORT", "50051"))


def compose(*args: str, timeout: float = 600, check: bool = True) -> str:
    return run([*COMPOSE, *args], timeout=timeout, check=check, env=ENV)


def container(service: str) -> str:
    ids = compose("ps", "-q", service).split()
    if not ids:
        raise CheckError(f"no container for {service}")
    return ids[0]


def state(service: str) -> dict:
    return json.loads(run(["docker", "inspect", "-f", "{{json .State}}", container(service)]))


def last_log_line(service: str) -> str:
    lines = compose("logs", "--no-color", "--tail", "5", service, check=False).strip().splitlines()
    return lines[-1] if lines else "(no log)"


def wait_healthy(services: tuple[str, ...], timeout_s: float = HEALTHY_TIMEOUT_S) -> float:
    """Seconds until every service's container is healthy; CheckError when one exits or time runs out."""
    start = time.monotonic()
    while True:
        pending = []
        for service in services:
            s = state(service)
            if s["Status"] == "exited":
                raise CheckError(f"{service} exited ({s['ExitCode']}): {last_log_line(service)}")
            if (s.get("Health") or {}).get("Status") != "healthy":
                pending.append(service)
        if not pending:
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            raise CheckError(f"not healthy after {timeout_s:.0f} s: {', '.join(pending)}")
        time.sleep(2)


def build(cold: bool) -> float:
    start = time.monotonic()
    env = {**os.environ, "NO_CACHE": "1"} if cold else None
    log = ROOT / "build" / f"deploy-check-image-{'cold' if cold else 'warm'}.log"
    log.parent.mkdir(exist_ok=True)
    with open(log, "w") as out:
        done = subprocess.run(["make", "-s", "image"], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise CheckError(f"make image failed; its log: {log}")
    return round(time.monotonic() - start, 1)


# ---- asking ------------------------------------------------------------------------------------

def openai_client():
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{HTTP_PORT}/v1", api_key=API_KEY, max_retries=0, timeout=180)
    return client, client.models.list().data[0].id


def ask_openai() -> str:
    client, model = openai_client()
    answer = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=MAX_TOKENS, temperature=0)
    return answer.choices[0].message.content or ""


def ask_grpc() -> str:
    kvfleet = str(Path(sys.executable).parent / "kvfleet")
    out = run([kvfleet, "generate", "--router", f"127.0.0.1:{GRPC_PORT}", "--api-key", API_KEY, "--chat",
               QUESTION, "--max-tokens", str(MAX_TOKENS), "--timeout", "180"], timeout=240)
    return out.split("\n[", 1)[0].strip()  # the streamed text, without the closing [finish: ...] line


def served_both(what: str) -> bool:
    """Both doors answer now: one request each, no retries (the router's own fail-over is what counts)."""
    ok = True
    for door, ask in (("openai", ask_openai), ("grpc", ask_grpc)):
        try:
            answer = ask()
            say(f"{what}: {door} answered {answer[:60]!r}")
            ok = ok and bool(answer)
        except Exception as exc:  # noqa: BLE001 - any failure of the request is the finding
            say(f"{what}: {door} failed: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            ok = False
    return ok


# ---- faults ------------------------------------------------------------------------------------

def crash(service: str) -> None:
    """SIGKILL to the container's main process from the host: to Docker a crash (not a `docker stop`)."""
    pid = state(service)["Pid"]
    os.kill(pid, signal.SIGKILL)
    say(f"killed {service} (pid {pid} on the host)")


def wait_restarted(service: str, restarts_before: int, timeout_s: float = HEALTHY_TIMEOUT_S) -> bool:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if restart_count(service) > restarts_before:
            wait_healthy((service,), timeout_s)
            say(f"{service} restarted by compose's policy and healthy again")
            return True
        time.sleep(1)
    return False


def restart_count(service: str) -> int:
    return int(run(["docker", "inspect", "-f", "{{.RestartCount}}", container(service)]).strip())


def operator(*args: str, entrypoint: str | None = None) -> str:
    """A one-off container as admin on the internal network (the etcd-auth service's mounts)."""
    extra = ["--entrypoint", entrypoint] if entrypoint else []
    return compose("run", "--rm", "--no-deps", "-T", *extra, "etcd-auth", *args, timeout=180)


def leader_term() -> tuple[str, int]:
    """The service whose address the etcd leader key names, and the key's create revision: a new
    leadership term makes the key anew, so a replica that lost the lease and won it back is a new term."""
    out = operator(f"--endpoints={ETCD_ENDPOINTS}", "--cacert=/certs/admin/ca.crt", "--cert=/certs/admin/tls.crt",
                   "--key=/certs/admin/tls.key", "get", "-w", "json", "/kvfleet/block_service/leader",
                   entrypoint="etcdctl").strip()
    kvs = json.loads(out.splitlines()[-1]).get("kvs") or []
    if not kvs:
        raise CheckError("no block_service leader in etcd")
    value = json.loads(base64.b64decode(kvs[0]["value"]))
    return value["address"].split(":")[0], int(kvs[0]["create_revision"])


def leader() -> str:
    return leader_term()[0]


def wait_new_term(old: tuple[str, int], timeout_s: float = 300) -> str:
    """The leader of the first term after ``old``: the standby, or the killed replica back first
    (compose restarts it; either way the writes went on under a new term). A term ends when its
    lease lapses, so the wait is at least the election TTL; each look is a one-off container."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            now = leader_term()
        except CheckError:
            now = old
        if now[1] != old[1]:
            return now[0]
        time.sleep(2)
    raise CheckError(f"no new block_service leadership term within {timeout_s:.0f} s (still {old[0]})")


def served_soon(what: str, timeout_s: float = 120) -> bool:
    """Both doors answer within timeout_s (a leader change is a gap the nodes and the router ride out)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if served_both(what):
            return True
        time.sleep(3)
    return False


def page_table() -> dict:
    """What block_service holds, as the operator's `kvfleet blocks --json` shows it from the leader."""
    lead = leader()
    out = operator("blocks", "--block-service", f"{lead}:50061", *ADMIN, "--json")
    return json.loads(out.strip().splitlines()[-1])


# what the page table and the tenants' charges are made of (not the event counters: not durable)
DURABLE_NODE = ("node_id", "num_blocks", "block_size", "used", "cached", "free", "num_sequences", "tiers", "lower_tier")
DURABLE_TENANT = ("tenant", "node_id", "charged", "quota", "reserved", "num_sequences", "lower_tier")


def durable_part(table: dict) -> dict:
    return {"nodes": [{k: n[k] for k in DURABLE_NODE} for n in table["nodes"]],
            "tenants": [{k: t[k] for k in DURABLE_TENANT} for t in table["tenants"]]}


def differences(before: dict, after: dict) -> list[str]:
    """Each row of the durable tables that is not the same after as before, both sides shown."""
    lines = []
    for part in ("nodes", "tenants"):
        rows_before, rows_after = before[part], after[part]
        for i in range(max(len(rows_before), len(rows_after))):
            b = rows_before[i] if i < len(rows_before) else None
            a = rows_after[i] if i < len(rows_after) else None
            if a != b:
                lines.append(f"{part}[{i}]: before {json.dumps(b)}, after {json.dumps(a)}")
    return lines


# ---- the check ---------------------------------------------------------------------------------

def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            return True
        except OSError:
            return False


def left_running() -> int:
    return len(run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}"]).split())


def check(result: dict) -> None:
    for port in (HTTP_PORT, GRPC_PORT):
        if not port_free(port):
            raise CheckError(f"host port {port} is taken: free it or set KVFLEET_HTTP_PORT / KVFLEET_GRPC_PORT")
    if os.environ.get("DEPLOY_CHECK_COLD", "1") != "0":
        say("building the image cold (--no-cache) ...")
        result["build_s_cold"] = build(cold=True)
    say("building the image again (cached) ...")
    result["build_s_warm"] = build(cold=False)
    result["image_built"] = bool(run(["docker", "image", "inspect", "-f", "{{.Id}}", "kvfleet:cpu"]).strip())
    say(f"image built: cold {result['build_s_cold']} s, warm {result['build_s_warm']} s")

    compose("down", "-v", "--remove-orphans")  # fresh volumes: the model is pulled, the certificates made
    start = time.monotonic()
    compose("up", "-d", timeout=HEALTHY_TIMEOUT_S)
    wait_healthy(CORE)
    result["healthy_s"] = round(time.monotonic() - start, 1)
    say(f"healthy after {result['healthy_s']} s")
    result["openai_answer"] = ask_openai()
    result["grpc_answer"] = ask_grpc()
    say(f"openai: {result['openai_answer']!r}; grpc: {result['grpc_answer']!r}")

    restarts = restart_count("compute-0")
    crash("compute-0")
    served = served_both("with compute-0 down")
    result["served_after_compute_kill"] = served and wait_restarted("compute-0", restarts) and served_both("compute-0 back")

    term = leader_term()
    old = term[0]
    restarts = restart_count(old)
    crash(old)
    new = wait_new_term(term)
    say(f"{new} leads now ({'the standby took over' if new != old else 'it came back and won the new term first'})")
    served = served_soon(f"with {old} down")
    result["served_after_leader_kill"] = served and wait_restarted(old, restarts)

    # the whole cluster killed at once (a host losing power: no node deregisters its pool, nothing drains),
    # idle (a request mid-generation changes the table while it is read, and a frozen node's 5 s etcd lease
    # lapses, which takes it out of what block_service reports), its containers removed, then up again
    # from its volumes: block_service first, alone, then the rest
    before = durable_part(page_table())
    say(f"before the restart: {json.dumps(before)[:400]}")
    compose("kill", timeout=300)
    compose("down", timeout=300)  # containers gone, volumes kept
    compose("up", "-d", *BLOCK_SERVICES, timeout=HEALTHY_TIMEOUT_S)
    wait_healthy((*ETCD, *BLOCK_SERVICES))
    after = durable_part(page_table())
    say(f"after the restart: {json.dumps(after)[:400]}")
    compose("up", "-d", timeout=HEALTHY_TIMEOUT_S)
    wait_healthy(CORE)
    cached = sum(n["cached"] for n in before["nodes"])  # the prefix cache the asks above left
    say(f"{len(before['nodes'])} pools, {cached} cached blocks, {len(before['tenants'])} tenant rows, before and after")
    for line in differences(before, after):
        say(f"not as before: {line}")
    result["state_survived_restart"] = before == after and cached > 0 and served_both("after the restart")


def main() -> int:
    result = {"image_built": False, "build_s_cold": None, "build_s_warm": None, "healthy_s": None,
              "openai_answer": None, "grpc_answer": None, "served_after_compute_kill": False,
              "served_after_leader_kill": False, "state_survived_restart": False, "left_running": None}
    code = 0
    try:
        check(result)
    except (CheckError, subprocess.TimeoutExpired) as exc:
        say(f"FAILED: {exc}")
        code = 1
    finally:
        compose("down", "-v", "--remove-orphans", timeout=300, check=False)
        result["left_running"] = left_running()
    print(json.dumps(result))
    return code or int(result["left_running"] != 0)


if __name__ == "__main__":
    sys.exit(main())
