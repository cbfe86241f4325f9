"""``kvfleet up``: a local cluster until Ctrl-C, whose processes are restarted when they die.

The supervisor polls the cluster's processes; a dead one is started again with the same command
line (same port, same state directory) after the delay its ``Restarts`` gives
(``kvfleet.cli.supervisor``), and each restart is one line on stderr and in ``supervisor.log`` in
the work directory. A process that crash-loops is given up on: the cluster stops, exit status 1.
Shutdown (Ctrl-C, SIGTERM) ends the polling before anything is stopped, so nothing that exits
during shutdown is restarted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.block_service.settings import EvictionSettings
from kvfleet.cli.canary_cluster import CanaryNodes, CanaryPlan
from kvfleet.cli.cluster_state import ClusterState
from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.cli.local_nodes import LOCAL_NODE_DEFAULTS, local_node_settings, node_roles
from kvfleet.cli.models_pull import default_model_dir
from kvfleet.cli.supervisor import RestartPolicy, Restarts
from kvfleet.compute_service.node.settings import NodeSettings
from kvfleet.core import settings
from kvfleet.core.settings import setting

TINY_MODEL = "models/demo-tiny"
POLL_S = 0.2

log = logging.getLogger(__name__)


class Supervisor:
    """Restarts the cluster's dead processes, each after its own backoff."""

    def __init__(self, cluster: LocalCluster, policy: RestartPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cluster = cluster
        self.policy = policy = policy or RestartPolicy()
        self.clock = clock
        now = clock()
        names = ["etcd", *(c.name for c in cluster.children())]
        self._backoffs = {name: Restarts(policy) for name in names}
        for backoff in self._backoffs.values():
            backoff.started(now)
        self._due: dict[str, float] = {}  # name → when to start it again

    def poll(self) -> str | None:
        """Notice exits, start what is due. Returns the name of a process given up on, else None."""
        now = self.clock()
        for name, code in self.cluster.exited().items():
            if name in self._due:
                continue
            decision = self._backoffs[name].exited(now)
            if not decision.restart:
                log.error("%s exited with code %s, %d times within %g s; giving up", name, code,
                          decision.crashes_in_window, self.policy.window_s)
                return name
            log.warning("%s exited with code %s; restarting in %g s (restart %d)", name, code,
                        decision.delay_s, decision.restart_number)
            self._due[name] = now + decision.delay_s
        for name, due in list(self._due.items()):
            if due <= now:
                del self._due[name]
                self.cluster.restart(name)
                self._backoffs[name].started(now)
        return None


@dataclass(slots=True)
class UpSettings:
    """``kvfleet up``: the local cluster's shape, and the settings every node of it takes (a node's
    own flags, with the local cluster's defaults where they differ: ``LOCAL_NODE_DEFAULTS``)."""

    nodes: int = setting(2, "compute nodes (at least --prefill-nodes + --decode-nodes: those first, mixed the rest)",
                         at_least=1, metavar="N")
    prefill_nodes: int = setting(0, "nodes that only prefill and hand the sequence over (kvfleet.core.roles)", at_least=0,
                                 metavar="N")
    decode_nodes: int = setting(0, "nodes that continue handed-over sequences, and short prompts", at_least=0,
                                metavar="N")
    model: str | None = setting(None, "model directory", unset=f"{default_model_dir()} when pulled (`kvfleet models "
                                f"pull smollm2`), else {TINY_MODEL}, random weights, made if missing", metavar="DIR")
    tenants: str | None = setting(None, "tenants YAML", unset="a demo file with gold and free", metavar="FILE")
    work_dir: str | None = setting(None, "logs and state", unset="a temporary directory", metavar="DIR")
    block_service_standby: bool = setting(False, "two block_service replicas (a leader and a synchronous standby "
                                          "that takes over when it dies), elected through the cluster's etcd")
    etcd_members: int = setting(1, "etcd members: 1 starts quickest; 3 are a real etcd cluster (one may die or be cut "
                                "off: every service is given all three and moves to the next)", at_least=1, metavar="N")
    insecure_internal: bool = setting(False, "plaintext between the services, no identities (a benchmark); by "
                                      "default they speak mutual TLS under a CA made in --work-dir/certs")
    start_timeout_s: float = setting(300.0, "how long the cluster may take to serve (a loaded machine loads models "
                                     "slowly; a child that exits fails the start at once)", above=0, metavar="S")
    canary_config: str | None = setting(None, "the canary's configuration: a file as --config takes, its values over "
                                        "the cluster's (kvfleet canary)", unset="no canary", metavar="FILE")
    canary_nodes: int = setting(0, "nodes (of --nodes) that run --canary-config, in group canary", at_least=0,
                                metavar="N")
    node: NodeSettings = field(default_factory=local_node_settings)
    eviction: EvictionSettings = field(default_factory=EvictionSettings)  # block_service's, passed on

    def __post_init__(self) -> None:
        settings.check(self)
        self.nodes = max(self.nodes, self.prefill_nodes + self.decode_nodes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_flags(parser, UpSettings, LOCAL_NODE_DEFAULTS)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML or TOML of these flags' values (block_size: 256, ...; `kvfleet tune` writes one); "
                             "flags given on the command line win")


def file_defaults(args: argparse.Namespace) -> dict:
    """The ``--config`` file's values (``kvfleet.cli.cli`` makes them the defaults)."""
    if args.config is None:
        return {}
    from kvfleet.cli.config_file import load

    return load(args.config, UpSettings)


def _log_to(path: Path) -> None:
    """The supervisor's lines go to ``path`` too, next to the services' own logs."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    for logger in (log, logging.getLogger("kvfleet.cli.canary_cluster")):  # restarts, and a rollout's steps
        logger.addHandler(handler)


def _model_dir(model: str | None) -> str:
    """The model to serve: the one given, else the pulled default, else the tiny one (made if
    missing); ``ValueError`` for a directory that holds no model."""
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"{model} is not a model directory (no config.json)")
        return model
    real = default_model_dir()
    if (real / "config.json").is_file():
        return str(real)
    print(f"{real} is not pulled (`kvfleet models pull smollm2`): serving {TINY_MODEL}, random weights", file=sys.stderr)
    if not (Path(TINY_MODEL) / "config.json").is_file():
        from kvfleet.cli.model_maker import make_model

        make_model(TINY_MODEL, preset="tiny")
    return TINY_MODEL


def run(args: argparse.Namespace) -> int:
    try:
        up = settings.build(UpSettings, args)
        model = _model_dir(up.model)
    except ValueError as e:  # a setting's rule, one between settings (the KV tiers), or no model there
        print(f"kvfleet up: {e}", file=sys.stderr)
        return 2
    if up.canary_nodes and (up.canary_config is None or up.canary_nodes >= up.nodes):
        print("kvfleet up: --canary-nodes needs --canary-config FILE and fewer canary nodes than --nodes",
              file=sys.stderr)
        return 2
    plan = CanaryPlan.load(up.canary_config, UpSettings, vars(args)) if up.canary_nodes else None
    stable_nodes = up.nodes - up.canary_nodes
    cluster = LocalCluster(model, stable_nodes, up.tenants, up.work_dir, node=up.node,
                           block_service_standby=up.block_service_standby, insecure_internal=up.insecure_internal,
                           etcd_members=up.etcd_members,
                           roles=node_roles(up.nodes, up.prefill_nodes, up.decode_nodes), eviction=up.eviction)
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    state = None
    try:
        try:
            cluster.start(timeout=up.start_timeout_s)
        except (RuntimeError, TimeoutError) as err:  # which child, and the end of its log
            print(f"kvfleet up: the cluster did not start: {err}", file=sys.stderr)
            return 1
        canary = None
        if plan is not None:
            canary = CanaryNodes(cluster, plan, [f"node-{i}" for i in range(stable_nodes, up.nodes)])
            canary.start(up.start_timeout_s)
        _log_to(cluster.work_dir / "supervisor.log")
        key = "sk-gold" if up.tenants is None else None
        replicas = tuple(f"127.0.0.1:{c.port}" for c in (cluster.block_service, cluster.block_service_standby)
                         if c is not None)
        state = ClusterState(cluster.router_address, os.getpid(), key, str(cluster.work_dir), replicas,
                             cluster.etcd.url, str(cluster.certs.root or ""),
                             cluster.metrics_urls.get("router", "").removesuffix("/metrics"))
        state_path = state.write()
        print(f"kvfleet is up: router at {cluster.router_address}, {up.nodes} compute nodes serving {model}, "
              f"etcd at {cluster.etcd.url}, logs in {cluster.work_dir}")
        print(f"internal connections: mutual TLS, certificates in {cluster.certs.root} (admin: "
              f"{cluster.certs.root}/admin)" if cluster.certs.root else
              "internal connections: PLAINTEXT (--insecure-internal): any local process can call them")
        if up.block_service_standby:
            print(f"block_service: two replicas electing their leader in etcd (leader {cluster.block_service_address}, "
                  f"a synchronous standby that takes over when it dies)")
        if plan is not None:
            print(f"canary: {up.canary_nodes} nodes on {plan.config_name}, split 0 until `kvfleet canary start "
                  f"--share S`" if not plan.problem else f"canary: NOT running ({plan.problem}); serving on stable")
        if cluster.router_unix_address:
            print(f"clients on this machine can use {cluster.router_unix_address}")
        print(f"OpenAI-compatible HTTP API at {cluster.http_url} (model {Path(model).name!r})")
        print("Prometheus metrics:" + "".join(f"\n  {name:<14} {url}" for name, url in cluster.metrics_urls.items()))
        key_arg = "" if key else " --api-key <your api key>"
        print(f"try:  kvfleet generate{key_arg} --chat \"What is the capital of France?\""
              f"   (the router's address is in {state_path})")
        print("Ctrl-C stops everything; a process that dies is restarted.", flush=True)
        supervisor = Supervisor(cluster)
        while not stop:
            if supervisor.poll() is not None:
                status = 1
                break
            if canary is not None:
                canary.poll()
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        pass
    finally:
        if cluster.router is not None and cluster.block_service is not None and any(
                c.alive() for c in (cluster.block_service, cluster.block_service_standby) if c is not None):
            try:
                print(cluster.summary())
            except Exception as e:  # the summary is a courtesy; stopping is what matters
                print(f"(no summary: {e})", file=sys.stderr)
        print("stopping the cluster ...", flush=True)
        if state is not None:
            state.remove()
        cluster.stop()
    return status
