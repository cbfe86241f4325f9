"""Two node settings against each other and against the engine in-process, in pairs.

A setting's effect on the cluster/in-process ratio is often smaller than the noise between two runs
of ``cluster_overhead.py`` on these machines. This keeps two local clusters up at once (A and B, each
etcd, block_service, one node, router) and interleaves in-process, A and B runs (A and B swap order
every round), so drift in the machine's speed hits all three alike; it prints each side's best and
median tokens/s and the ratios against in-process.

    python bench/cluster_ab.py --a "--batch-wait-ms 0" --b "--batch-wait-ms 2" [--rounds 10]
    python bench/cluster_ab.py --a-env KVFLEET_EVENT_LOOP=asyncio [--quick]

``--a`` / ``--b`` are extra ``kvfleet compute`` arguments; ``--a-env`` / ``--b-env`` are NAME=VALUE
environment settings for every process of that cluster.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cluster_overhead import (  # noqa: E402
    BLOCK_SIZE,
    FULL,
    KV_CACHE_MEMORY,
    QUICK,
    SMOKE,
    _through_router,
    run_inprocess,
)
from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model, seeded_prompts  # noqa: E402


def _env(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--a-env/--b-env take NAME=VALUE, got {pair!r}")
        env[name] = value
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="", help="extra kvfleet compute arguments for cluster A")
    parser.add_argument("--b", default="", help="extra kvfleet compute arguments for cluster B")
    parser.add_argument("--a-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--b-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="the smaller shape of cluster_overhead --quick")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.smoke:
        args.rounds = 1
    sides = {"A": (shlex.split(args.a), _env(args.a_env)), "B": (shlex.split(args.b), _env(args.b_env))}

    from kvfleet.cli.local_cluster import LocalCluster
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.event_loop import run as run_loop

    model = ensure_model("tiny", ROOT / "models" / "bench-tiny") if args.smoke else ensure_model()
    prompts = seeded_prompts(cfg["requests"], cfg["min_len"], cfg["max_len"], seed=1)
    warm = seeded_prompts(cfg["requests"], cfg["min_len"], cfg["max_len"], seed=2)
    engine = LLMEngine(model, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=KV_CACHE_MEMORY))
    run_inprocess(engine, warm, 8)
    run_inprocess(engine, prompts, cfg["new_tokens"])  # the prompts cached, as they will be in the nodes
    runs: dict[str, list[float]] = {"in-process": [], "A": [], "B": []}

    def cluster(name: str) -> LocalCluster:
        compute_args, env = sides[name]
        return LocalCluster(model, num_nodes=1, block_size=BLOCK_SIZE, kv_cache_memory=KV_CACHE_MEMORY,
                            log_level="WARNING", env=env, compute_args=tuple(compute_args))

    with cluster("A") as a, cluster("B") as b:
        routers = {"A": a.router_address, "B": b.router_address}
        for address in routers.values():
            run_loop(_through_router(address, warm, 8))
            run_loop(_through_router(address, prompts, cfg["new_tokens"]))
        for i in range(args.rounds):
            runs["in-process"].append(run_inprocess(engine, prompts, cfg["new_tokens"])["tokens_per_s"])
            for name in ("A", "B") if i % 2 == 0 else ("B", "A"):
                runs[name].append(run_loop(_through_router(routers[name], prompts, cfg["new_tokens"]))["tokens_per_s"])

    ref_best, ref_median = max(runs["in-process"]), statistics.median(runs["in-process"])
    result = {
        name: dict(best=max(v), median=statistics.median(v), runs=[round(x, 1) for x in v],
                   ratio=max(v) / ref_best, median_ratio=statistics.median(v) / ref_median)
        for name, v in runs.items()
    }
    result["A"]["setting"] = {"args": args.a, "env": sides["A"][1]}
    result["B"]["setting"] = {"args": args.b, "env": sides["B"][1]}
    if args.json:
        print(json.dumps({**result, "dtype": engine_dtype()}))  # the nodes' (auto, resolved here alike)
        return
    print(f"{cfg['requests']} requests × {cfg['new_tokens']} tokens, {args.rounds} rounds")
    for name, r in result.items():
        setting = f"  ({r['setting']['args']} {r['setting']['env'] or ''})".rstrip() if "setting" in r else ""
        print(f"  {name:<10} best {r['best']:7.1f}  median {r['median']:7.1f} tok/s   "
              f"ratio best {r['ratio']:.3f}  of medians {r['median_ratio']:.3f}{setting}")


if __name__ == "__main__":
    main()
