"""``kvfleet up``: a local cluster until Ctrl-C, whose processes are restarted when they die.

The supervisor polls the cluster's processes; a dead one is started again with the same command
line (same port, same state directory) after the delay its ``Backoff`` gives
(``kvfleet_cli.supervisor``), and each restart is one line on stderr and in ``supervisor.log`` in
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
from pathlib import Path

from compute_service.kv.cache_dtype import KV_CACHE_DTYPES
from compute_service.kv.layout import KV_LAYOUTS
from compute_service.kv.tier_flags import add_tier_arguments, check_tier_flags
from kvfleet_cli.cluster_state import ClusterState
from kvfleet_cli.local_cluster import LocalCluster
from kvfleet_cli.models_pull import default_model_dir
from kvfleet_cli.supervisor import Backoff, RestartPolicy

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
        self._backoffs = {name: Backoff(policy) for name in names}
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=2, help="compute nodes (default 2)")
    parser.add_argument("--model", default=None,
                        help=f"model directory (default {default_model_dir()} when pulled (`kvfleet models pull "
                             f"smollm2`), else {TINY_MODEL}, random weights, made if missing)")
    parser.add_argument("--tenants", default=None, help="tenants YAML (default: a demo file with gold and free)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes of KV pool per node")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the nodes' compute dtype (default auto: bfloat16 on a CPU with native bfloat16, "
                             "else float32; float32 is token-exact against transformers)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="the nodes' KV pool dtype: auto, float32, bfloat16, float16, fp8_e4m3")
    parser.add_argument("--kv-layout", default="paged", help="the nodes' KV layout: paged or contiguous (max_model_len "
                        "reserved per sequence, no prefix sharing)")
    parser.add_argument("--max-model-len", type=int, default=None, help="the nodes' longest sequence (default: the model's)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=0, metavar="N",
                        help="the nodes' scheduling of long prompts: more than N tokens left to prefill, a prompt "
                             "yields to shorter ones (`kvfleet compute --long-prefill-token-threshold`; default 0: off)")
    parser.add_argument("--work-dir", default=None, help="logs and state (default: a temporary directory)")
    parser.add_argument("--block-service-standby", action="store_true",
                        help="two block_service replicas (a leader and a synchronous standby that takes over "
                             "when it dies), elected through the cluster's etcd")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML or TOML of these flags' values (block_size: 256, ...; `kvfleet tune` writes one); "
                             "flags given on the command line win")
    add_tier_arguments(parser)
    parser.add_argument("--kv-snapshot-dir", default=None,
                        help="the nodes' KV snapshots (`kvfleet compute --kv-snapshot-dir`): written when a node "
                             "drains, restored when it starts, so a restarted cluster starts warm (default: off)")


def _layout_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The nodes' ``--kv-layout``, ``--max-model-len`` and ``--long-prefill-token-threshold``, as
    ``kvfleet compute`` takes them."""
    limit = () if args.max_model_len is None else ("--max-model-len", str(args.max_model_len))
    return ("--kv-layout", args.kv_layout, *limit,
            "--long-prefill-token-threshold", str(args.long_prefill_token_threshold))


def _tier_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The nodes' host tier and preemption mode (each node's disk tier is a directory of its own:
    ``LocalCluster``'s ``kv_disk``)."""
    return ("--kv-host-memory", str(args.kv_host_memory), "--preemption-mode", args.preemption_mode)


def _snapshot_args(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--kv-snapshot-dir", args.kv_snapshot_dir) if args.kv_snapshot_dir else ()


def file_defaults(args: argparse.Namespace) -> dict:
    """The ``--config`` file's values (``kvfleet_cli.cli`` makes them the defaults)."""
    if args.config is None:
        return {}
    from kvfleet_cli.config_file import load

    flags = {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("config", "command", "log_level")}
    return load(args.config, flags)


def _log_to(path: Path) -> None:
    """The supervisor's lines go to ``path`` too, next to the services' own logs."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1:
        print("--nodes must be at least 1", file=sys.stderr)
        return 2
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        print(f"kvfleet up: --kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}",
              file=sys.stderr)
        return 2
    if args.kv_layout not in KV_LAYOUTS:
        print(f"kvfleet up: --kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {args.kv_layout!r}", file=sys.stderr)
        return 2
    if args.max_model_len is not None and args.max_model_len < 1:
        print(f"kvfleet up: --max-model-len must be at least 1, got {args.max_model_len}", file=sys.stderr)
        return 2
    if args.long_prefill_token_threshold < 0:
        print(f"kvfleet up: --long-prefill-token-threshold must be >= 0, got {args.long_prefill_token_threshold}",
              file=sys.stderr)
        return 2
    try:
        check_tier_flags(args.kv_host_memory, args.kv_disk_dir, args.kv_disk_bytes, args.preemption_mode)
    except ValueError as e:
        print(f"kvfleet up: {e}", file=sys.stderr)
        return 2
    if args.model is None:
        real = default_model_dir()
        args.model = str(real) if (real / "config.json").is_file() else TINY_MODEL
        if args.model == TINY_MODEL:
            print(f"{real} is not pulled (`kvfleet models pull smollm2`): serving {TINY_MODEL}, random weights",
                  file=sys.stderr)
            if not (Path(TINY_MODEL) / "config.json").is_file():
                from kvfleet_cli.model_maker import make_model

                make_model(TINY_MODEL, preset="tiny")
    elif not (Path(args.model) / "config.json").is_file():
        print(f"kvfleet up: {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    cluster = LocalCluster(args.model, args.nodes, args.tenants, args.work_dir, args.block_size, args.kv_cache_memory,
                           kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype,
                           block_service_standby=args.block_service_standby,
                           compute_args=(*_layout_args(args), *_snapshot_args(args), *_tier_args(args)),
                           kv_disk=(args.kv_disk_dir, args.kv_disk_bytes) if args.kv_disk_dir else None)
    stop = False

    def on_signal(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    status = 0
    state = None
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError) as err:  # which child, and the end of its log
            print(f"kvfleet up: the cluster did not start: {err}", file=sys.stderr)
            return 1
        _log_to(cluster.work_dir / "supervisor.log")
        key = "sk-gold" if args.tenants is None else None
        replicas = tuple(f"127.0.0.1:{c.port}" for c in (cluster.block_service, cluster.block_service_standby)
                         if c is not None)
        state = ClusterState(cluster.router_address, os.getpid(), key, str(cluster.work_dir), replicas,
                             cluster.etcd.url)
        state_path = state.write()
        print(f"kvfleet is up: router at {cluster.router_address}, {args.nodes} compute nodes serving {args.model}, "
              f"etcd at {cluster.etcd.url}, logs in {cluster.work_dir}")
        if args.block_service_standby:
            print(f"block_service: two replicas electing their leader in etcd (leader {cluster.block_service_address}, "
                  f"a synchronous standby that takes over when it dies)")
        if cluster.router_unix_address:
            print(f"clients on this machine can use {cluster.router_unix_address}")
        print(f"OpenAI-compatible HTTP API at {cluster.http_url} (model {Path(args.model).name!r})")
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
