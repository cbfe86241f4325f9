"""``kvfleet bench``: the field guide's three-phase stress test through the public API, against any
router (``--router``, ``--api-key``) or a local cluster it starts itself (``--local --model DIR``).

    kvfleet bench --local --model models/smollm2-135m-instruct --phases fixed,mixed,soak \\
        --context 512 --mix 0.2:8k,0.8:128k --scale 0.01 --duration 60 --out bench-out

Results go to ``--out``: summary.json, requests.csv, kv_usage.csv and PNG plots. The phases are
``kvfleet.cli.loadgen.phases``; this module parses, validates, starts the cluster when asked and
writes the report.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
from pathlib import Path

from kvfleet.cli.cluster_certs import add_admin_flag, use_admin
from kvfleet.cli.cluster_state import ClusterState
from kvfleet.cli.loadgen.analysis import StopRule
from kvfleet.cli.loadgen.phases import PHASES, PhasePlan
from kvfleet.cli.loadgen.workload import Mix, parse_tokens
from kvfleet.cli.local_nodes import LOCAL_NODE_DEFAULTS

DEFAULT_VOCAB = 256  # against a remote router without --vocab-size: ids every served model knows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_argument_group("where")
    where.add_argument("--router", default=os.environ.get("KVFLEET_ROUTER"), help="router host:port")
    where.add_argument("--api-key", default=os.environ.get("KVFLEET_API_KEY"), help="tenant API key")
    where.add_argument("--block-service", default=None, metavar="ADDR",
                       help="with --router: block_service's address, to sample KV usage (else not sampled)")
    add_admin_flag(where)
    where.add_argument("--router-metrics", default=None, metavar="URL",
                       help="with --router: the router's /metrics URL, to set its counters beside the bench's")
    where.add_argument("--local", action="store_true", help="start a local cluster on --model and bench it")
    where.add_argument("--model", default=None, help="model directory (with --local: served; else: its vocabulary)")
    add_cluster_arguments(parser)
    load = parser.add_argument_group("load")
    load.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, of {', '.join(PHASES)}")
    load.add_argument("--context", default="512", help="fixed phase: prompt tokens (512, 8k, ...; default 512)")
    load.add_argument("--mix", default="0.7:512,0.3:2k",
                      help="mixed and soak phases: weight:length pairs, e.g. 0.2:8k,0.8:128k (default 0.7:512,0.3:2k)")
    load.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (e.g. 0.01)")
    load.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    load.add_argument("--step", type=int, default=1, help="fixed phase: concurrency increment (default 1)")
    load.add_argument("--max-concurrency", type=int, default=32, help="fixed phase: the last step at most (32)")
    load.add_argument("--requests-per-client", type=int, default=4,
                      help="fixed phase: requests per step = concurrency x this (default 4)")
    load.add_argument("--knee", type=float, default=4.0,
                      help="fixed phase stops when p99 TTFT exceeds this x the first step's (default 4)")
    load.add_argument("--min-gain", type=float, default=0.05,
                      help="fixed phase stops when tokens/s gain less than this share over a step (0.05)")
    load.add_argument("--concurrency", type=int, default=None,
                      help="mixed and soak phases: clients (default: the fixed phase's best step, else 4)")
    load.add_argument("--requests", type=int, default=32, help="mixed phase: requests (default 32)")
    load.add_argument("--duration", type=float, default=60.0, help="soak phase: seconds (default 60)")
    load.add_argument("--sample-every", type=float, default=0.5, help="seconds between KV / memory samples (0.5)")
    load.add_argument("--timeout", type=float, default=120.0, help="seconds per request before it counts as timed out")
    load.add_argument("--vocab-size", type=int, default=None, help="prompt ids below this (default: --model's)")
    load.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out", help="output directory (default bench-out)")


def add_cluster_arguments(parser: argparse.ArgumentParser, with_block_size: bool = True) -> None:
    """The local cluster's shape (``kvfleet up``'s flags), shared with ``kvfleet tune`` (which
    searches the block size instead of taking it)."""
    group = parser.add_argument_group("local cluster")
    group.add_argument("--nodes", type=int, default=1, help="compute nodes (default 1)")
    block_size, pool = LOCAL_NODE_DEFAULTS["block_size"], LOCAL_NODE_DEFAULTS["kv_cache_memory"]
    if with_block_size:
        group.add_argument("--block-size", type=int, default=block_size, help=f"tokens per KV block (default {block_size})")
    group.add_argument("--kv-cache-memory", type=int, default=pool, help=f"bytes of KV pool per node (default {pool})")
    group.add_argument("--kv-cache-dtype", default="auto", help="auto, float32, bfloat16, float16, fp8_e4m3")
    group.add_argument("--start-timeout", type=float, default=600.0,
                       help="seconds the local cluster may take to be ready (default 600: a loaded machine)")


def phase_plan(args: argparse.Namespace, vocab_size: int, concurrency: int | None = None) -> PhasePlan:
    """``ValueError`` with one line for any bad flag."""
    if args.scale <= 0:
        raise ValueError(f"--scale must be positive, got {args.scale}")
    if args.sample_every <= 0 or args.timeout <= 0:
        raise ValueError("--sample-every and --timeout must be positive")
    return PhasePlan(
        context=max(1, round(parse_tokens(args.context) * args.scale)), mix=Mix.parse(args.mix).scaled(args.scale),
        max_tokens=args.max_tokens, vocab_size=vocab_size, step=args.step, max_concurrency=args.max_concurrency,
        requests_per_client=args.requests_per_client, stop_rule=StopRule(args.knee, args.min_gain),
        concurrency=concurrency if concurrency is not None else args.concurrency, mixed_requests=args.requests,
        soak_s=args.duration, seed=args.seed)


def parse_phases(text: str) -> tuple[str, ...]:
    chosen = tuple(p.strip() for p in text.split(",") if p.strip())
    unknown = [p for p in chosen if p not in PHASES]
    if unknown or not chosen:
        raise ValueError(f"--phases takes some of {', '.join(PHASES)}; got {text!r}")
    return tuple(p for p in PHASES if p in chosen)


def check_fits(plan: PhasePlan, phases: tuple[str, ...], max_positions: int) -> None:
    longest = plan.longest_request(phases)
    if longest > max_positions:
        raise ValueError(f"the longest request ({longest} tokens with --max-tokens) exceeds the model's "
                         f"{max_positions} positions: lower --context / --mix or pass --scale")


def _fail(line: str, status: int = 1) -> int:
    print(line if line.startswith("kvfleet ") else f"kvfleet bench: {line}", file=sys.stderr)
    return status


def run(args: argparse.Namespace) -> int:
    from kvfleet.cli.loadgen import report
    from kvfleet.cli.loadgen.client import RouterProblem
    from kvfleet.cli.loadgen.local import ClusterShape, model_limits, process_ids, running_cluster
    from kvfleet.cli.loadgen.session import Target, run_session

    try:
        phases = parse_phases(args.phases)
        limits = model_limits(args.model) if args.model else None
        vocab = args.vocab_size or (limits.vocab_size if limits else DEFAULT_VOCAB)
        plan = phase_plan(args, vocab)
        if limits:
            check_fits(plan, phases, limits.max_positions)
        if args.local and not args.model:
            raise ValueError("--local needs --model DIR (the model the local cluster serves)")
        if args.local and args.router:
            raise ValueError("--local starts its own router: drop --router")
        shape = ClusterShape(args.model, args.nodes, args.block_size, args.kv_cache_memory, args.kv_cache_dtype) \
            if args.local else None
    except ValueError as err:
        return _fail(str(err), 2)
    out = Path(args.out)
    if (problem := report.check_writable(out)) is not None:
        return _fail(problem, 2)
    if not args.local:
        from kvfleet.cli.generate_client import find_router

        find_router(args)
        try:
            state = ClusterState.read()
            use_admin(args.certs, state.certs if state is not None else None)  # to sample block_service
        except ValueError as err:
            return _fail(str(err), 2)
    try:
        with contextlib.ExitStack() as stack:
            if shape is not None:
                print(f"kvfleet bench: starting a local cluster ({shape.nodes} node(s), blocks of {shape.block_size}) "
                      f"on {shape.model} ...", file=sys.stderr, flush=True)
                cluster = stack.enter_context(running_cluster(shape, args.start_timeout))
                from kvfleet.cli.loadgen.local import BENCH_KEY

                target = Target(cluster.router_address, BENCH_KEY, cluster.block_service_address,
                                cluster.metrics_urls.get("router"), lambda: process_ids(cluster))
            else:
                target = Target(args.router, args.api_key or "", args.block_service, args.router_metrics)
            outcome = run_session(target, plan, phases, args.timeout, args.sample_every)
    except RouterProblem as err:
        return _fail(str(err))
    except KeyboardInterrupt:  # the cluster, if ours, is stopped on the way out
        return _fail("interrupted; nothing written", 130)
    except (RuntimeError, TimeoutError) as err:  # the local cluster did not start: which child, its log
        return _fail(f"the local cluster did not start: {err}")
    summary = bench_summary(args, plan, phases, target, outcome, shape)
    report.write(out, summary, outcome.results, outcome.samples)
    for line in report.lines(outcome.results):
        print(line)
    for note in summary["notes"]:
        print(f"note: {note}")
    print(f"results in {out}/ ({', '.join(summary['files'])})")
    return 0


def bench_summary(args, plan: PhasePlan, phases, target, outcome, shape) -> dict:
    from dataclasses import asdict

    from kvfleet.cli.loadgen.report import client_totals, phase_json

    notes = []
    if target.block_service is None:
        notes.append("KV usage not sampled: no --block-service address for a remote router")
    elif outcome.kv_problem:
        notes.append(f"KV usage sampling stopped: {outcome.kv_problem}")
    if shape is None:
        notes.append("process memory not sampled: the router's processes are remote (use --local to sample RSS)")
    if target.router_metrics is None:
        notes.append("the router's counters not read: no --router-metrics URL")
    kv = [s for s in outcome.samples if s.blocks_used is not None]
    return {
        "command": "kvfleet bench",
        "router": "local" if shape else target.router,
        "cluster": asdict(shape) if shape else None,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "phases_run": list(phases),
        "plan": {"context": plan.context, "mix": plan.mix.describe(), "scale": args.scale,
                 "max_tokens": plan.max_tokens, "vocab_size": plan.vocab_size, "knee_factor": plan.stop_rule.knee_factor,
                 "min_gain": plan.stop_rule.min_gain, "step": plan.step, "max_concurrency": plan.max_concurrency},
        "phases": {res.name: phase_json(res) for res in outcome.results},
        "kv_usage": {"samples": len(kv), "peak_blocks_used": max((s.blocks_used for s in kv), default=None),
                     "blocks_total": kv[0].blocks_total if kv else None,
                     "blocks_used_at_end": kv[-1].blocks_used if kv else None},
        "client_totals": client_totals(outcome.results),
        "router_counters": asdict(outcome.counters) if outcome.counters else None,
        "notes": notes,
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
