"""KV fetched between nodes (issue 28) against recomputing it, as a fleet of processes serves it.

Part 1, one prefix at a time: a local cluster of two nodes (``--kv-fetch auto``: a warm-up fetch
each way measures the rate it decides with; each repeat's ``cached_tokens`` shows that it fetched),
requests written straight to a node as the router writes them (``kvfleet.cli.node_direct``). Per
prefix length L and repeat, a fresh random prompt P (L tokens of the vocabulary, then ``SUFFIX``
more, so that its last block is partial and every prefix block is fetchable):

    node-0 (A)   P from scratch, nothing cached anywhere: the recompute TTFT, and the reference tokens
    node-1 (B)   P again: only A holds its L tokens' blocks; B fetches them and prefills the suffix:
                 the fetch TTFT, and its tokens against A's (``tokens_identical``)

Both nodes run the same command line on the same machine, and the two TTFTs are of the same
prompt. TTFT is the node's (start command written, channel already up, to the first token), the
median of the repeats. ``transfer_gbps`` is B's bytes fetched over its fetches' whole time (its
``kvfleet:kv_fetch_bytes_total`` and ``kvfleet:kv_fetch_seconds`` deltas over the repeats: blocks
reserved, streamed, checked, written, committed); ``memcpy_gbps`` a torch copy of one fetch's bytes
in this process, best of several.

Part 2, multi-turn: a conversation group (conversations under one long system prompt, short
questions, each turn's prompt the whole history, earlier replies included), its system prompt
cached on node-0 only, the conversations arriving together through the router's gRPC door
(``bench/routing.py``'s client). Every turn prefers node-0, which holds the most of it, until
node-0's queue makes the router (its hot-spot guard, or its cost) send turns to node-1. Served
twice, the same seeded schedule: by part 1's cluster (node-1 fetches the prefix from node-0) and by
a cluster of nodes ``--kv-fetch off`` under a router with ``--peer-hit-weight 0`` (the fleet before
KV moved between nodes: node-1 recomputes it); the mean TTFT of all turns on each, the turns the
guard moved (``hot_spot_routes``) and the turns served by another node than their previous one
(``moved_turns``).

Every node runs one intra-op thread (OMP_NUM_THREADS=1: two nodes on two cores), ``--dtype float32``
and ``--kv-cache-dtype float32`` by default (both always passed, never the CPU's default), blocks of
``--block-size`` tokens (the local cluster's 16), routers with ``--warmup-s 0``. The clusters' work
directories (their logs) are kept; their WARNING, ERROR and traceback lines are in ``log_problems``.

    python bench/kv_transfer.py [--quick] [--json] [--dtype float32] [--kv-cache-dtype float32]
                                [--block-size 16] [--repeats N] [--skip-multi-turn]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag  # noqa: E402
from bench.plan_vs_measured import cpu_model  # noqa: E402
from bench.routing import _run, schedule, summarize  # noqa: E402
from kvfleet.router.routing import RoutingConfig  # noqa: E402

MODEL = ROOT / "models" / "smollm2-135m-instruct"
FULL = dict(prefixes=(512, 2048, 4096), repeats=3, kv_cache_mib=512,
            chat=dict(conversations=8, turns=4, system_prompts=1, system_len=2048, user_len=(64, 128), reply=16,
                      mean_gap_s=0.05, think_s=0.5))
QUICK = dict(prefixes=(512, 1024), repeats=2, kv_cache_mib=256,
             chat=dict(conversations=8, turns=3, system_prompts=1, system_len=1024, user_len=(48, 96), reply=8,
                       mean_gap_s=0.05, think_s=0.3))
SMOKE = dict(prefixes=(64,), repeats=1, kv_cache_mib=64,
             chat=dict(conversations=2, turns=2, system_prompts=1, system_len=64, user_len=(8, 16), reply=4,
                       mean_gap_s=0.05, think_s=0.1))
SUFFIX = 8        # prompt tokens past the prefix: P's last block is partial, so every prefix block is fetchable
MAX_TOKENS = 8    # greedy tokens per request: compared, fetched against recomputed
WARM_BLOCKS = 8   # the warm-up prompts' full blocks (at least --kv-fetch-min-blocks)
NODES = ("node-0", "node-1")
LOG_MARKS = (" WARNING ", " ERROR ", "Traceback")


def start_cluster(mode: str, args, kv_cache_mib: int, router_args: tuple[str, ...] = ()):
    from kvfleet.cli.local_cluster import LocalCluster

    return LocalCluster(MODEL, num_nodes=2, block_size=args.block_size, kv_cache_memory=kv_cache_mib << 20,
                        dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, log_level="INFO", http=False,
                        compute_args=("--kv-fetch", mode), router_args=("--warmup-s", "0", *router_args),
                        env={"OMP_NUM_THREADS": "1"})


def fetch_totals(cluster, node_id: str) -> dict[str, float]:
    """The node's fetch counters now: blocks, bytes, seconds (the histogram's sum), fetches, fallbacks."""
    from kvfleet.cli.node_direct import metric, node_metrics

    s = node_metrics(cluster, node_id)
    return dict(blocks=metric(s, "kvfleet:kv_fetch_blocks_total"), bytes=metric(s, "kvfleet:kv_fetch_bytes_total"),
                seconds=metric(s, "kvfleet:kv_fetch_seconds_sum"), fetches=metric(s, "kvfleet:kv_fetch_seconds_count"),
                fallbacks=metric(s, "kvfleet:kv_fetch_fallbacks_total"))


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def log_problems(work_dir: Path) -> list[str]:
    """The WARNING, ERROR and traceback lines of a cluster's logs (its work directory keeps them)."""
    return [f"{path.name}: {line.strip()}" for path in sorted(work_dir.glob("*.log"))
            for line in path.read_text(errors="replace").splitlines() if any(m in line for m in LOG_MARKS)]


def memcpy_gbps(nbytes: int, repeats: int = 10) -> float:
    """A plain memory copy of ``nbytes`` in this process (best of ``repeats``), GB/s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9


def one(cluster, node_id: str, name: str, prompt: list[int]):
    from kvfleet.cli.node_direct import run_on

    answer = run_on(cluster, node_id, name, prompt, MAX_TOKENS)
    if answer.error or answer.ttft_s is None:
        raise SystemExit(f"kv_transfer: {name} on {node_id} failed: {answer.error or 'no token'}")
    return answer


def measure_prefix(cluster, length: int, repeats: int, rng: random.Random, vocab: int) -> dict:
    """Part 1 at one prefix length (module docstring)."""
    fetch_s, recompute_s, identical, cached = [], [], True, []
    before = fetch_totals(cluster, "node-1")
    for r in range(repeats):
        prompt = [rng.randrange(vocab) for _ in range(length + SUFFIX)]
        reference = one(cluster, "node-0", f"scratch-{length}-{r}", prompt)
        fetched = one(cluster, "node-1", f"fetch-{length}-{r}", prompt)
        fetch_s.append(fetched.ttft_s)
        recompute_s.append(reference.ttft_s)
        cached.append(fetched.cached_tokens)
        identical &= fetched.tokens == reference.tokens
    moved = delta(fetch_totals(cluster, "node-1"), before)
    per_fetch = moved["bytes"] / max(moved["fetches"], 1)
    transfer = moved["bytes"] / moved["seconds"] / 1e9 if moved["seconds"] else 0.0
    memcpy = memcpy_gbps(int(per_fetch)) if per_fetch else 0.0
    fetch, recompute = statistics.median(fetch_s), statistics.median(recompute_s)
    return dict(fetch_ttft_s=round(fetch, 4), recompute_ttft_s=round(recompute, 4),
                ttft_ratio=round(recompute / fetch, 2), transfer_gbps=round(transfer, 3), memcpy_gbps=round(memcpy, 3),
                tokens_identical=identical, fetch_ttfts_s=[round(t, 4) for t in fetch_s],
                recompute_ttfts_s=[round(t, 4) for t in recompute_s], cached_tokens=cached,
                fetches=int(moved["fetches"]), fetch_fallbacks=int(moved["fallbacks"]),
                mib_per_fetch=round(per_fetch / (1 << 20), 1))


def warm(cluster, vocab: int, length: int, rng: random.Random) -> None:
    """Each node's first requests (kernels, the prefill rate) and a fetch each way (the peer
    channels; the fetch rate an ``auto`` node decides with)."""
    for holder, taker in (NODES, NODES[::-1]):
        p = [rng.randrange(vocab) for _ in range(length + SUFFIX)]
        one(cluster, holder, f"warm-{holder}", p)
        one(cluster, taker, f"warm-{taker}", p)


def wait_peer_weights(cluster, timeout_s: float = 30.0) -> dict[str, float]:
    """The router's peer weight per node once both nodes' measured fetch rates reached it (through
    their membership records), or what it has at the timeout."""
    from kvfleet.cli.node_direct import node_metrics

    deadline, weights = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        samples = node_metrics(cluster, "router")
        weights = {dict(labels)["node"]: v for (name, labels), v in samples.items()
                   if name == "kvfleet:router_node_peer_weight"}
        if len(weights) == len(NODES) and all(w != RoutingConfig().peer_hit_weight for w in weights.values()):
            break
        time.sleep(0.5)
    return weights


def chat(cluster, shape: dict, fetching: bool) -> dict:
    """Part 2 on a started cluster: the group's system prompt cached on node-0 only, then the
    conversations through the router: routing's summary of the run, with its replies, the nodes'
    fetches and the router's hot-spot decisions during it."""
    from kvfleet.cli.node_direct import metric, node_metrics
    from kvfleet.core.event_loop import run as run_loop

    conversations = schedule(shape)
    one(cluster, "node-0", "group-system", conversations[0].system + [0] * SUFFIX)
    weights = wait_peer_weights(cluster) if fetching else {}
    before = {n: fetch_totals(cluster, n) for n in NODES}
    hot_before = metric(node_metrics(cluster, "router"), "kvfleet:routing_decisions_total", reason="hot_spot")
    run = run_loop(_run(cluster.router_address, conversations, shape))
    fetched = [delta(fetch_totals(cluster, n), before[n]) for n in NODES]
    hot = metric(node_metrics(cluster, "router"), "kvfleet:routing_decisions_total", reason="hot_spot") - hot_before
    summary = summarize(run, shape["system_len"])
    node_of = {(t.conversation, t.turn): t.node for t in run.turns}
    moved = sum(t.turn > 0 and t.node != node_of[t.conversation, t.turn - 1] for t in run.turns)
    summary.update(replies=run.replies, moved_turns=moved, fetches=int(sum(m["fetches"] for m in fetched)),
                   fetched_blocks=int(sum(m["blocks"] for m in fetched)),
                   fetch_fallbacks=int(sum(m["fallbacks"] for m in fetched)), hot_spot_routes=int(hot),
                   peer_weights={n: round(w, 3) for n, w in weights.items()})
    return summary


def fetching_side(args, shape: dict, vocab: int) -> tuple[dict, dict | None, Path, float]:
    """Part 1, then part 2's fetching side, on one ``--kv-fetch auto`` cluster: (part 1's figures by
    prefix length, the chat's summary or None, the cluster's work directory, node-0's prefill tokens/s)."""
    from kvfleet.cli.node_direct import metric, node_metrics

    rng = random.Random(0)
    with start_cluster("auto", args, shape["kv_cache_mib"]) as cluster:
        warm(cluster, vocab, WARM_BLOCKS * args.block_size, rng)
        by_prefix = {}
        for length in shape["prefixes"]:
            by_prefix[str(length)] = measure_prefix(cluster, length, args.repeats or shape["repeats"], rng, vocab)
            progress(f"prefix {length}: {by_prefix[str(length)]}")
        rate = metric(node_metrics(cluster, "node-0"), "kvfleet:node_prefill_tokens_per_second")
        summary = None if args.skip_multi_turn else chat(cluster, shape["chat"], fetching=True)
    return by_prefix, summary, cluster.work_dir, rate


def recomputing_side(args, shape: dict, vocab: int) -> tuple[dict, Path]:
    """Part 2's other side: nodes ``--kv-fetch off`` under a router with ``--peer-hit-weight 0``."""
    with start_cluster("off", args, shape["kv_cache_mib"], ("--peer-hit-weight", "0")) as cluster:
        warm(cluster, vocab, WARM_BLOCKS * args.block_size, random.Random(0))
        summary = chat(cluster, shape["chat"], fetching=False)
    return summary, cluster.work_dir


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def side(summary: dict) -> dict:
    keys = ("moved_turns", "fetches", "fetched_blocks", "fetch_fallbacks", "hot_spot_routes", "peer_weights",
            "per_node", "per_turn")
    return dict({k: summary[k] for k in keys}, mean_ttft_s=round(summary["mean_ttft_s"], 4),
                p90_ttft_s=round(summary["p90_ttft_s"], 4), hit_rate=round(summary["hit_rate"], 4))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="prefixes of 512 and 1,024 tokens, a smaller chat")
    parser.add_argument("--json", action="store_true", help="only the JSON object (last line)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp8_e4m3"])
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    parser.add_argument("--repeats", type=int, default=None, help="prompts per prefix length (default 3; quick 2)")
    parser.add_argument("--skip-multi-turn", action="store_true", help="part 1 only")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.block_size % 16 or not 16 <= args.block_size <= 2048:
        parser.error("--block-size must be a multiple of 16 in 16-2048 (the nodes' rule)")
    if not (MODEL / "config.json").is_file():
        raise SystemExit(f"kv_transfer: no model at {MODEL} (make model fetches it)")
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    vocab = json.loads((MODEL / "config.json").read_text())["vocab_size"]
    started = time.perf_counter()
    by_prefix, fetch, work_dir, prefill_rate = fetching_side(args, shape, vocab)
    work_dirs = [work_dir]
    top = by_prefix[str(max(shape["prefixes"]))]
    result = {k: top[k] for k in ("fetch_ttft_s", "recompute_ttft_s", "ttft_ratio", "transfer_gbps", "memcpy_gbps",
                                  "tokens_identical")}
    result.update(prefix_tokens=max(shape["prefixes"]), by_prefix=by_prefix,
                  node_prefill_tokens_per_s=round(prefill_rate, 1))
    if fetch is not None:
        progress(f"multi-turn, fetching: mean TTFT {fetch['mean_ttft_s']:.3f} s")
        recompute, work_dir = recomputing_side(args, shape, vocab)
        work_dirs.append(work_dir)
        result.update(mean_ttft_s_fetch=round(fetch["mean_ttft_s"], 4),
                      mean_ttft_s_recompute=round(recompute["mean_ttft_s"], 4),
                      mean_ttft_ratio=round(recompute["mean_ttft_s"] / fetch["mean_ttft_s"], 2),
                      multi_turn=dict(shape=shape["chat"], identical_replies=fetch["replies"] == recompute["replies"],
                                      fetch=side(fetch), recompute=side(recompute)))
    problems = [f"{d.name}/{line}" for d in work_dirs for line in log_problems(d)]
    result.update(cpu=cpu_model(), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size,
                  model=MODEL.name, quick=args.quick, seconds=round(time.perf_counter() - started),
                  work_dirs=[str(d) for d in work_dirs], num_log_problems=len(problems), log_problems=problems[:20])
    if not args.json:
        print(f"{MODEL.name}, {args.dtype} (KV {args.kv_cache_dtype}), blocks of {args.block_size}, on {result['cpu']}")
        print("| prefix tokens | fetch TTFT s | recompute TTFT s | ratio | transfer GB/s | memcpy GB/s | identical |")
        print("|---:|---:|---:|---:|---:|---:|---|")
        for length, row in by_prefix.items():
            print(f"| {length} | {row['fetch_ttft_s']:.3f} | {row['recompute_ttft_s']:.3f} | {row['ttft_ratio']}x | "
                  f"{row['transfer_gbps']} | {row['memcpy_gbps']} | {row['tokens_identical']} |")
        if "mean_ttft_ratio" in result:
            print(f"multi-turn mean TTFT: fetch {result['mean_ttft_s_fetch']:.3f} s, recompute "
                  f"{result['mean_ttft_s_recompute']:.3f} s: {result['mean_ttft_ratio']}x (goal >= 1.5x)")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
