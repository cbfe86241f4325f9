"""``kvfleet tune``: the block size that gives the most throughput with p99 inter-token latency
under ``--slo-ms``, measured, each candidate on a fresh local cluster.

    kvfleet tune --model models/smollm2-135m-instruct --slo-ms 200 --mix 0.5:256,0.5:1k \\
        --concurrency 4 --requests 16 --out tune-out

A baseline with ``kvfleet up``'s defaults first, then the search (``kvfleet.cli.loadgen.search``:
golden-section over the log₂ grid, with repeats, then the best two confirmed). Writes the winner as
``kvfleet-tuned.yaml`` (``kvfleet up --config kvfleet-tuned.yaml``), ``report.md`` (the table),
``tune.png`` and ``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

from kvfleet.cli.bench_command import add_cluster_arguments, check_fits, cpu_model
from kvfleet.cli.loadgen.phases import PhasePlan
from kvfleet.cli.loadgen.workload import Mix
from kvfleet.cli.local_nodes import LOCAL_NODE_DEFAULTS

BASELINE_BLOCK_SIZE = LOCAL_NODE_DEFAULTS["block_size"]  # kvfleet up's default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model directory the candidates serve")
    add_cluster_arguments(parser, with_block_size=False)
    parser.add_argument("--slo-ms", type=float, required=True, help="p99 inter-token latency to stay under (ms)")
    parser.add_argument("--block-sizes", default="64-1024",
                        help="the grid: LOW-HIGH (powers of two between) or a comma list (default 64-1024)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per candidate during the search (default 1)")
    parser.add_argument("--confirm", type=int, default=1, help="extra runs of each of the best two (default 1)")
    load = parser.add_argument_group("workload (one closed-loop run per measurement)")
    load.add_argument("--mix", default="0.7:512,0.3:2k", help="weight:length pairs (default 0.7:512,0.3:2k)")
    load.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length")
    load.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    load.add_argument("--concurrency", type=int, default=4, help="clients (default 4)")
    load.add_argument("--requests", type=int, default=16, help="requests per run (default 16)")
    load.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    load.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="tune-out", help="output directory (default tune-out)")


def parse_grid(text: str) -> list[int]:
    from kvfleet.cli.loadgen.search import log2_grid

    try:
        if "-" in text:
            low, high = (int(x) for x in text.split("-", 1))
            return log2_grid(low, high)
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--block-sizes takes LOW-HIGH or a comma list of powers of two, got {text!r}") from None
    for v in sizes:
        log2_grid(v, v)
    if not sizes:
        raise ValueError("--block-sizes is empty")
    return sizes


def _fail(line: str, status: int = 1) -> int:
    print(f"kvfleet tune: {line}", file=sys.stderr)
    return status


def run(args: argparse.Namespace) -> int:
    from kvfleet.cli.loadgen import report
    from kvfleet.cli.loadgen.client import RouterProblem
    from kvfleet.cli.loadgen.local import BENCH_KEY, ClusterShape, model_limits, running_cluster
    from kvfleet.cli.loadgen.progress import Progress
    from kvfleet.cli.loadgen.search import Run, Search
    from kvfleet.cli.loadgen.session import Target, run_session

    try:
        limits = model_limits(args.model)
        if args.scale <= 0:
            raise ValueError(f"--scale must be positive, got {args.scale}")
        plan = PhasePlan(context=1, mix=Mix.parse(args.mix).scaled(args.scale), max_tokens=args.max_tokens,
                         vocab_size=limits.vocab_size, concurrency=args.concurrency, mixed_requests=args.requests,
                         seed=args.seed)
        check_fits(plan, ("mixed",), limits.max_positions)
        grid = parse_grid(args.block_sizes)
        base_shape = ClusterShape(args.model, args.nodes, BASELINE_BLOCK_SIZE, args.kv_cache_memory,
                                  args.kv_cache_dtype)
    except ValueError as err:
        return _fail(str(err), 2)
    out = Path(args.out)
    if (problem := report.check_writable(out)) is not None:
        return _fail(problem, 2)

    def measure(block_size: int, stage: str) -> Run:
        shape = replace(base_shape, block_size=block_size)
        try:
            with running_cluster(shape, args.start_timeout) as cluster:
                target = Target(cluster.router_address, BENCH_KEY, cluster.block_service_address)
                outcome = run_session(target, plan, ("mixed",), args.timeout, progress=Progress())
        except (RuntimeError, TimeoutError) as err:  # this size cannot serve: a failed candidate, not a failed tune
            print(f"block size {block_size:>5} ({stage}): the cluster did not start: {str(err).splitlines()[0]}",
                  flush=True)
            return Run(block_size, stage, 0.0, math.nan, 0, plan.mixed_requests)
        stats = outcome.results[0].stats
        p99 = stats.itl_s["p99"]
        result = Run(block_size, stage, stats.tokens_per_s, p99 * 1000 if p99 is not None else math.nan,
                     stats.completed, stats.requests)
        print(f"block size {block_size:>5} ({stage}): {result.tokens_per_s:8.1f} tokens/s, p99 inter-token "
              f"{result.p99_itl_ms:7.1f} ms, {result.completed}/{result.requests} finished", flush=True)
        return result

    try:
        search = Search(grid, args.slo_ms, measure, args.repeats, args.confirm)
        baseline = [measure(BASELINE_BLOCK_SIZE, "baseline") for _ in range(args.repeats)]
        winner = search.run()
    except ValueError as err:
        return _fail(str(err), 2)
    except RouterProblem as err:
        return _fail(str(err))
    except KeyboardInterrupt:
        return _fail("interrupted; nothing written", 130)
    from kvfleet.cli.loadgen.tune_report import write_tune

    lines = write_tune(out, args, plan, base_shape, baseline, search, winner, cpu_model())
    print("\n".join(lines))
    return 0
