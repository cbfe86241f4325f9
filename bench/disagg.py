"""Prefill and decode on separate nodes (issue 29) against two mixed nodes, the same arrivals.

Chat streams (short prompts, a few dozen greedy tokens each) arrive over the run while long
documents (``--quick``: 2,048-3,072 tokens; default 4,096-7,168, under SmolLM2-135M's 8,192
positions) arrive every ``--doc-gap-s`` seconds wanting a few tokens each. The same seeded schedule
is served twice, each time by a fresh local cluster (etcd, block_service, router, two nodes):

    mixed     two ``--role mixed`` nodes: a document's prefill shares its node's steps with the
              chat streams decoding there
    disagg    ``--role prefill`` + ``--role decode``: the router prefills a prompt whose uncached part
              is at least ``--disagg-min-uncached-tokens`` (the router's default, 512) on the prefill
              node, streams its first token, and hands the sequence to the decode node, which fetches
              the prompt's KV and continues; the chats' short prompts run on the decode node

Both arms' nodes run ``--long-prefill-token-threshold`` at its best measured setting (bench/routing.py's
128: short prompts first, a document's chunk 128 tokens a step alone, a block beside them), one intra-op
thread each (OMP_NUM_THREADS=1: two nodes on two cores), ``--dtype`` and ``--kv-cache-dtype`` as given
(float32 by default, always passed: never the CPU's default), blocks of 16; routers ``--warmup-s 0``.

Measured by the client on the router's gRPC door, per token: ``itl_p99_ms`` over the chat streams'
gaps between consecutive tokens (nearest rank); ``ttft_mean_s`` over every request; ``tokens_per_s``
generated tokens over the wall time from the first arrival to the last token; ``tokens_identical``:
every request's greedy tokens (``ignore_eos``, fixed ``max_tokens``) equal across the arms. Each
arm's hand-overs (router), KV fetched (nodes) and its logs' WARNING, ERROR and traceback lines come
with it; the clusters' work directories are kept: their logs, and ``outcomes.json`` (every request's
send time, token times, tokens and nodes, in seconds from the run's start).

``threshold_sweep`` (bench/disagg_sweep.py; ``--skip-sweep`` leaves it out): after the disagg arm, on
its cluster, one prompt at a time per length while a stream decodes on the decode node, with the
router's threshold at 1 (always hand over) and at 10^9 (never: the decode node prefills it).

    python bench/disagg.py [--quick] [--json] [--dtype float32] [--kv-cache-dtype float32]
                           [--doc-gap-s S] [--disagg-min-uncached-tokens N] [--skip-sweep]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag  # noqa: E402
from bench.disagg_client import API_KEY, Outcome, generate, server_figures  # noqa: E402
from bench.disagg_sweep import threshold_sweep  # noqa: E402
from bench.kv_transfer import log_problems, progress  # noqa: E402
from bench.plan_vs_measured import cpu_model  # noqa: E402
from bench.routing import LONG_PREFILL_TOKEN_THRESHOLD  # noqa: E402
from kvfleet.compute_service.engine.config import DTYPES  # noqa: E402
from kvfleet.compute_service.kv.cache_dtype import KV_CACHE_DTYPES  # noqa: E402
from kvfleet.router.disagg import DisaggConfig  # noqa: E402

MODEL = ROOT / "models" / "smollm2-135m-instruct"
FULL = dict(chats=36, chat_len=(64, 128), chat_tokens=64, chat_window_s=320.0, docs=4, doc_len=(4096, 7168),
            doc_tokens=8, doc_gap_s=80.0, kv_cache_mib=1024, sweep=(64, 256, 1024, 4096))
QUICK = dict(chats=12, chat_len=(64, 128), chat_tokens=48, chat_window_s=70.0, docs=3, doc_len=(2048, 3072),
             doc_tokens=8, doc_gap_s=20.0, kv_cache_mib=512, sweep=(64, 256, 1024))
SMOKE = dict(chats=2, chat_len=(8, 16), chat_tokens=4, chat_window_s=2.0, docs=1, doc_len=(128, 192),
             doc_tokens=4, doc_gap_s=2.0, kv_cache_mib=64, sweep=(64,))
BLOCK_SIZE = 16
# one tenant that holds every document at once on either arm (the demo's gold has 256 MiB)
TENANTS = f"""\
tenants:
  - name: bench
    api_key: {API_KEY}
    quota_mib: 16384
    paid_level: 2
    max_concurrent: 64
"""
START_TIMEOUT_S = 300  # a loaded machine loads the models slowly (kvfleet up's --start-timeout-s)
WARM_LONG = 640   # the warm-up's long prompts: past the router's default threshold, so they hand over


@dataclass(slots=True, frozen=True)
class Arrival:
    name: str          # chat-<i> or doc-<i>
    at_s: float        # from the run's start
    prompt: list[int]
    max_tokens: int

    @property
    def chat(self) -> bool:
        return self.name.startswith("chat")


def schedule(shape: dict, vocab: int, seed: int = 0) -> list[Arrival]:
    """The seeded arrivals: documents every ``doc_gap_s`` from 1 s, chats at uniform random times in
    the chat window; prompts are random token ids of the vocabulary."""
    rng = random.Random(seed)

    def prompt(low: int, high: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(low, high))]

    docs = [Arrival(f"doc-{i}", 1.0 + i * shape["doc_gap_s"], prompt(*shape["doc_len"]), shape["doc_tokens"])
            for i in range(shape["docs"])]
    chats = [Arrival(f"chat-{i}", rng.uniform(0.0, shape["chat_window_s"]), prompt(*shape["chat_len"]),
                     shape["chat_tokens"]) for i in range(shape["chats"])]
    return sorted(docs + chats, key=lambda a: a.at_s)


async def serve(address: str, arrivals: list[Arrival]) -> tuple[list[Outcome], float]:
    """Every arrival at its time, concurrently: the outcomes and the wall time (first arrival to last token)."""
    import grpc

    from kvfleet.v1 import inference_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = inference_pb2_grpc.InferenceStub(channel)
        t0 = time.perf_counter()

        async def one(arrival: Arrival) -> Outcome:
            await asyncio.sleep(max(0.0, arrival.at_s - (time.perf_counter() - t0)))
            return await generate(stub, arrival.prompt, arrival.max_tokens, arrival.name)

        outcomes = await asyncio.gather(*(one(a) for a in arrivals))
        return [o.shifted(t0) for o in outcomes], time.perf_counter() - t0 - arrivals[0].at_s


async def warm(address: str, vocab: int) -> None:
    """Each node's first requests (kernels built and loaded, the peer channels of a hand-over): two
    long prompts at once, then two short ones at once."""
    import grpc

    from kvfleet.v1 import inference_pb2_grpc

    rng = random.Random(99)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for length in (WARM_LONG, 64):
            await asyncio.gather(*(generate(stub, [rng.randrange(vocab) for _ in range(length)], 4)
                                   for _ in range(2)))


def make_cluster(args, shape: dict, disagg: bool):
    """The arm's cluster, not started; in a temporary work directory whose logs outlive it."""
    from kvfleet.cli.local_cluster import LocalCluster
    from kvfleet.cli.local_nodes import node_roles

    cluster = LocalCluster(
        MODEL, num_nodes=2, roles=node_roles(2, prefill=1, decode=1) if disagg else None, block_size=BLOCK_SIZE,
        kv_cache_memory=shape["kv_cache_mib"] << 20, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        log_level="WARNING", http=False, env={"OMP_NUM_THREADS": "1"},
        compute_args=("--long-prefill-token-threshold", str(args.long_prefill_token_threshold)),
        router_args=("--warmup-s", "0", "--disagg-min-uncached-tokens", str(args.disagg_min_uncached_tokens)))
    Path(cluster.tenants_file).write_text(TENANTS)  # in place of the demo tenants it wrote
    return cluster


def summarize(arrivals: list[Arrival], outcomes: list[Outcome], seconds: float) -> dict:
    from kvfleet.compute_service.engine.batch_controller import p99

    chat = [o for a, o in zip(arrivals, outcomes) if a.chat]
    docs = [o for a, o in zip(arrivals, outcomes) if not a.chat]
    gaps = [g for o in chat for g in o.gaps_s]
    generated = sum(len(o.tokens) for o in outcomes)
    first_nodes = [o.nodes[0] for o in outcomes if o.nodes]
    # whether the chats met what the arms differ in: a gap that ended while a document was prefilled
    # (sent, not yet its first token), or while it moved (its first token, not yet its second)
    prefilling = [(o.sent_at, o.times[0]) for o in docs]
    moving = [(o.times[0], o.times[1]) for o in docs if len(o.times) > 1]
    ends = [b for o in chat for b in o.times[1:]]
    return dict(
        itl_p99_ms=round(p99(gaps) * 1e3, 1), itl_p50_ms=round(statistics.median(gaps) * 1e3, 1),
        itl_max_ms=round(max(gaps) * 1e3, 1), chat_gaps=len(gaps),
        chat_gaps_while_prefilling=sum(any(a < t <= b for a, b in prefilling) for t in ends),
        chat_gaps_while_handing_over=sum(any(a < t <= b for a, b in moving) for t in ends),
        ttft_mean_s=round(statistics.fmean(o.ttft_s for o in outcomes), 3),
        ttft_mean_s_chat=round(statistics.fmean(o.ttft_s for o in chat), 3),
        ttft_mean_s_doc=round(statistics.fmean(o.ttft_s for o in docs), 3) if docs else None,
        tokens_per_s=round(generated / seconds, 2), generated_tokens=generated, seconds=round(seconds, 1),
        moved_requests=sum(len(set(o.nodes)) > 1 for o in outcomes),
        first_token_from={n: first_nodes.count(n) for n in sorted(set(first_nodes))})


def run_arm(args, shape: dict, arrivals: list[Arrival], vocab: int, disagg: bool) -> tuple[dict, dict]:
    """One arm on a fresh cluster: (its summary, each request's tokens by name); with ``disagg`` and
    no ``--skip-sweep``, the threshold sweep follows on the same cluster."""
    from kvfleet.core.event_loop import run as run_loop

    name = "disagg" if disagg else "mixed"
    cluster = make_cluster(args, shape, disagg)
    work_dir = Path(cluster.work_dir)
    progress(f"{name}: starting a cluster in {work_dir}")
    cluster.start(timeout=START_TIMEOUT_S)
    try:
        run_loop(warm(cluster.router_address, vocab))
        before = server_figures(cluster)
        progress(f"{name}: {len(arrivals)} arrivals")
        outcomes, seconds = run_loop(serve(cluster.router_address, arrivals))
        after = server_figures(cluster)
        summary = summarize(arrivals, outcomes, seconds)
        (work_dir / "outcomes.json").write_text(json.dumps([dataclasses.asdict(o) for o in outcomes]))
        summary.update({k: round(after[k] - before[k], 3) for k in after})
        summary["fetched_mib"] = round(summary.pop("fetched_bytes") / (1 << 20), 1)
        progress(f"{name}: {json.dumps(summary)}")
        if disagg and not args.skip_sweep:
            summary["threshold_sweep"] = threshold_sweep(cluster, shape["sweep"], vocab, progress)
    finally:
        cluster.stop()
    summary.update(work_dir=str(work_dir), log_problems=log_problems(work_dir))
    return summary, {o.name: o.tokens for o in outcomes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 documents of 2-3K tokens, 12 chats (9-12 minutes on 2 CPUs at a load of 5-9)")
    parser.add_argument("--json", action="store_true", help="only the JSON object (last line)")
    parser.add_argument("--dtype", default="float32", choices=[d for d in DTYPES if d != "auto"],
                        help="the nodes' compute dtype, always passed (default float32: tokens_identical)")
    parser.add_argument("--kv-cache-dtype", default="float32", choices=[d for d in KV_CACHE_DTYPES if d != "auto"],
                        help="the nodes' KV pool dtype, always passed (default float32)")
    parser.add_argument("--doc-gap-s", type=float, default=None, help="seconds between documents (default 80; quick 20)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=LONG_PREFILL_TOKEN_THRESHOLD,
                        help=f"both arms' nodes' threshold (default {LONG_PREFILL_TOKEN_THRESHOLD}, its best measured)")
    parser.add_argument("--disagg-min-uncached-tokens", type=int, default=DisaggConfig().disagg_min_uncached_tokens,
                        help="the routers' hand-over threshold (default: the router's)")
    parser.add_argument("--skip-sweep", action="store_true", help="leave out the threshold sweep")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.doc_gap_s is not None and args.doc_gap_s <= 0:
        parser.error("--doc-gap-s must be positive")
    if args.long_prefill_token_threshold < 0 or args.disagg_min_uncached_tokens < 1:
        parser.error("--long-prefill-token-threshold must be >= 0 and --disagg-min-uncached-tokens >= 1")
    if not (MODEL / "config.json").is_file():
        raise SystemExit(f"disagg: no model at {MODEL} (make model fetches it)")
    shape = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    if args.doc_gap_s is not None:
        shape["doc_gap_s"] = args.doc_gap_s
    config = json.loads((MODEL / "config.json").read_text())
    if shape["doc_len"][1] + shape["doc_tokens"] > config["max_position_embeddings"]:
        raise SystemExit(f"disagg: documents of {shape['doc_len'][1]} tokens do not fit the model's positions")
    started, load = time.perf_counter(), os.getloadavg()[0]
    arrivals = schedule(shape, config["vocab_size"])
    mixed, mixed_tokens = run_arm(args, shape, arrivals, config["vocab_size"], disagg=False)
    disagg, disagg_tokens = run_arm(args, shape, arrivals, config["vocab_size"], disagg=True)
    sweep = disagg.pop("threshold_sweep", None)
    result = dict(
        itl_p99_ms_disagg=disagg["itl_p99_ms"], itl_p99_ms_mixed=mixed["itl_p99_ms"],
        itl_p99_ratio=round(mixed["itl_p99_ms"] / disagg["itl_p99_ms"], 2),
        ttft_mean_s_disagg=disagg["ttft_mean_s"], ttft_mean_s_mixed=mixed["ttft_mean_s"],
        tokens_per_s_disagg=disagg["tokens_per_s"], tokens_per_s_mixed=mixed["tokens_per_s"],
        tokens_per_s_ratio=round(disagg["tokens_per_s"] / mixed["tokens_per_s"], 3),
        tokens_identical=disagg_tokens == mixed_tokens,
        cpu=cpu_model(), dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        disagg_min_uncached_tokens=args.disagg_min_uncached_tokens, block_size=BLOCK_SIZE, model=MODEL.name,
        quick=args.quick, shape={k: v for k, v in shape.items() if k != "sweep"}, mixed=mixed, disagg=disagg)
    if sweep is not None:
        result["threshold_sweep"] = sweep
    result.update(load_avg_1m=[round(load, 2), round(os.getloadavg()[0], 2)],
                  seconds=round(time.perf_counter() - started))
    if not args.json:
        print_table(result)
    print(json.dumps(result))
    return 0


def print_table(result: dict) -> None:
    print(f"{result['model']}, {result['dtype']} (KV {result['kv_cache_dtype']}), threshold "
          f"{result['long_prefill_token_threshold']}, hand-over from {result['disagg_min_uncached_tokens']} "
          f"uncached tokens, on {result['cpu']}")
    print("| arm | ITL p50 / p99 / max ms | TTFT mean s (chats / docs) | tokens/s | hand-overs | KV fetched MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in ("mixed", "disagg"):
        a = result[name]
        print(f"| {name} | {a['itl_p50_ms']} / {a['itl_p99_ms']} / {a['itl_max_ms']} | {a['ttft_mean_s']} "
              f"({a['ttft_mean_s_chat']} / {a['ttft_mean_s_doc']}) | {a['tokens_per_s']} | {a['handovers']:g} | "
              f"{a['fetched_mib']} |")
    print(f"ITL p99 ratio (mixed / disagg): {result['itl_p99_ratio']}x (goal >= 2); tokens/s disagg / mixed: "
          f"{result['tokens_per_s_ratio']} (goal >= 0.85); tokens identical: {result['tokens_identical']}")
    if "threshold_sweep" in result:
        sweep = result["threshold_sweep"]
        print("threshold sweep, one request at a time while a stream decodes on the decode node:")
        print("| prompt tokens | decoding stream's longest gap, hand over / not, ms | TTFT s, hand over / not | "
              "hand-over's cost to the request s | KV fetched MiB in s |")
        print("|---:|---:|---:|---:|---:|")
        for n, r in sweep["by_length"].items():
            print(f"| {n} | {r['decoding_max_gap_ms_always']} / {r['decoding_max_gap_ms_never']} | {r['ttft_s_always']} / "
                  f"{r['ttft_s_never']} | {r['handover_cost_s']} | {r['fetched_mib']} in {r['fetch_s']} |")
        crossover = sweep["crossover_tokens"]
        print("the hand-over shortens the decoding stream's longest gap " +
              (f"from {crossover} prompt tokens on" if crossover else "at no swept length"))


if __name__ == "__main__":
    sys.exit(main())
