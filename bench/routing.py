"""KV-aware routing against load-only routing on multi-turn conversations, same arrivals.

Conversations share a few system prompts; each turn's prompt is the whole history so far (system
prompt, earlier user turns and the model's own earlier replies), so a node that served a
conversation's last turn holds all but its newest user message. The default shape (``long``) opens
each conversation with a document; ``--shape short`` is short turns under long system prompts at a
load that saturates the cluster. A local cluster of ``--nodes`` nodes (etcd, block_service, router)
serves the same seeded schedule twice, each time on a fresh cluster: the router's default KV-aware
routing (the cost of a node is ``--prefix-weight`` times its uncached prompt blocks plus its load:
blocks still to prefill, and decoding requests' blocks at ``--decode-block-weight``) and load-only
routing (``--prefix-weight 0``, the same load). Reports mean and p90 time to first token, the prefix
hit rate (cached / prompt tokens, from each request's usage), throughput, and per turn where the
time went (``per_turn``).

The load-only side is, by default, a fleet with no KV awareness at all: its nodes do not fetch a
prompt's cached prefix from each other either (``--load-kv-fetch off``), as independent serving
engines behind a load balancer. Nodes that fetch (``--load-kv-fetch auto``) hand load-only routing
most of the hits KV-aware routing earns (same hit rate, measured 2026-12-02): that run isolates what
routing adds on top of fetching.

    python bench/routing.py [--quick] [--json] [--shape long|short] [--nodes 2] [--rounds 1]
                            [--prefix-weight W] [--decode-block-weight D] [--kv-cache-mib M]
                            [--kv-fetch auto|always|off] [--load-kv-fetch off|auto|always]
                            [--long-prefill-token-threshold N] [--mean-gap-s G] [--think-s T]

Each node runs one intra-op thread (OMP_NUM_THREADS=1), so two nodes share this machine's two cores
without oversubscribing them, in float32 (the shapes' load was set by float32's speed; ``auto``
would be bfloat16 on a CPU with native bfloat16, twice as fast), with
``--long-prefill-token-threshold 128`` (prompts with more than 128 tokens left to compute yield to
shorter ones: ``0`` turns it off); the router's cold-start ramp is off (``--warmup-s 0``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, ensure_model  # noqa: E402
from kvfleet.compute_service.node.fetch_policy import FETCH_MODES  # noqa: E402
from kvfleet.router.routing import RoutingConfig  # noqa: E402

# Long-context chat: each conversation opens with a document (768-1,024 tokens) under one of four
# shared system prompts, then short questions; arrivals and think times leave the cluster loaded but
# not saturated (in a saturated closed loop TTFT is queueing in both modes: "short" below).
FULL = dict(conversations=32, turns=4, system_prompts=4, system_len=512, first_user_len=(768, 1024),
            user_len=(32, 96), reply=64, mean_gap_s=3.0, think_s=3.0, kv_cache_mib=512)
QUICK = dict(conversations=8, turns=3, system_prompts=2, system_len=256, first_user_len=(384, 512),
             user_len=(16, 48), reply=16, mean_gap_s=1.0, think_s=1.0, kv_cache_mib=128)
# the first pass's shape: long shared system prompts, short user turns, arrivals that saturate two
# one-thread nodes; a node's 128 MiB (8,192 tokens of bench-small) holds under a third of its
# working set (4 system prompts + 32 histories, ~28K tokens)
SHORT_CHAT = dict(conversations=32, turns=4, system_prompts=4, system_len=1024, user_len=(64, 192), reply=64,
                  mean_gap_s=0.5, think_s=0.5, kv_cache_mib=128)
SMOKE = dict(conversations=2, turns=2, system_prompts=1, system_len=32, first_user_len=(32, 48),
             user_len=(8, 16), reply=4, mean_gap_s=0.2, think_s=0.1, kv_cache_mib=16)
SHAPES = {"long": FULL, "short": SHORT_CHAT}
BLOCK_SIZE = 16
# the nodes' --long-prefill-token-threshold: a question that arrives while a document is prefilled
# goes first and waits one short step, not the document's whole prefill (docs/benchmarks-history.md, "Routing")
LONG_PREFILL_TOKEN_THRESHOLD = 128
API_KEY = "sk-gold"
VOCAB = 256


@dataclass(slots=True)
class Conversation:
    start_s: float                 # arrival of the first turn, from the run's start
    system: list[int]
    user_turns: list[list[int]]


@dataclass(slots=True)
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    node: str


@dataclass(slots=True)
class RunResult:
    turns: list[TurnResult] = field(default_factory=list)
    seconds: float = 0.0
    replies: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (conversation, turn) → tokens


def schedule(shape: dict, seed: int = 0) -> list[Conversation]:
    """The seeded workload: conversation arrivals (exponential gaps), their system prompts (one of
    ``system_prompts``, round robin) and their user turns."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(shape["system_len"])] for _ in range(shape["system_prompts"])]
    lengths = [shape.get("first_user_len", shape["user_len"])] + [shape["user_len"]] * (shape["turns"] - 1)
    start, conversations = 0.0, []
    for i in range(shape["conversations"]):
        users = [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for low, high in lengths]
        conversations.append(Conversation(start, systems[i % len(systems)], users))
        start += rng.expovariate(1 / shape["mean_gap_s"])
    return conversations


async def _run(address: str, conversations: list[Conversation], shape: dict) -> RunResult:
    import grpc

    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    result = RunResult()
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = inference_pb2_grpc.InferenceStub(channel)
        t0 = time.perf_counter()

        async def turn(index: int, t: int, prompt: list[int]) -> tuple[TurnResult, list[int]]:
            request = inference_pb2.GenerateRequest(
                tokens=inference_pb2.TokenIds(ids=prompt),
                sampling=inference_pb2.SamplingParams(max_tokens=shape["reply"], ignore_eos=True))
            sent, first, tokens, usage, node = time.perf_counter(), None, [], None, ""
            async for chunk in stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=600):
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                tokens.extend(chunk.token_ids)
                node = chunk.node_id or node
                if chunk.HasField("usage"):
                    usage = chunk.usage
            return TurnResult(index, t, first - sent, usage.prompt_tokens, usage.cached_tokens, len(tokens), node), tokens

        async def converse(index: int, conv: Conversation) -> None:
            await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - t0)))
            history = list(conv.system)
            for t, user in enumerate(conv.user_turns):
                history += user
                outcome, reply = await turn(index, t, history)
                result.turns.append(outcome)
                result.replies[(index, t)] = reply
                history += reply
                await asyncio.sleep(shape["think_s"])

        await asyncio.gather(*(converse(i, c) for i, c in enumerate(conversations)))
        result.seconds = time.perf_counter() - t0
    return result


def run_mode(model: Path, conversations: list[Conversation], shape: dict, nodes: int, prefix_weight: float,
             kv_cache_memory: int, decode_block_weight: float | None = None,
             compute_args: tuple[str, ...] = ()) -> RunResult:
    from kvfleet.cli.local_cluster import LocalCluster
    from kvfleet.core.event_loop import run as run_loop

    router_args = ("--prefix-weight", str(prefix_weight), "--warmup-s", "0")
    if decode_block_weight is not None:
        router_args += ("--decode-block-weight", str(decode_block_weight))
    with LocalCluster(model, num_nodes=nodes, block_size=BLOCK_SIZE, kv_cache_memory=kv_cache_memory,
                      log_level="WARNING", router_args=router_args, env={"OMP_NUM_THREADS": "1"}, dtype="float32",
                      http=False, metrics=False, compute_args=compute_args) as cluster:
        warm = [Conversation(0.0, [7] * 64, [[9] * 16])]  # kernels built and loaded on some node
        for _ in range(nodes):
            run_loop(_run(cluster.router_address, warm, dict(shape, think_s=0.0, reply=2)))
        return run_loop(_run(cluster.router_address, conversations, shape))


def per_turn(run: RunResult, system_len: int) -> list[dict]:
    """Per turn index (0 = every conversation's first): mean TTFT, mean uncached prompt tokens (the
    prefill each turn paid), how many turns went to the node that served the conversation's previous
    turn, and how many found more than the system prompt cached (some of their history): where
    routing's gain or loss shows."""
    by_key = {(t.conversation, t.turn): t for t in run.turns}
    rows = []
    for index in sorted({t.turn for t in run.turns}):
        turns = [t for t in run.turns if t.turn == index]
        before = [by_key.get((t.conversation, index - 1)) for t in turns]
        rows.append(dict(
            turn=index, mean_ttft_s=round(statistics.fmean(t.ttft_s for t in turns), 3),
            mean_uncached_tokens=round(statistics.fmean(t.prompt_tokens - t.cached_tokens for t in turns)),
            same_node=sum(b is not None and b.node == t.node for t, b in zip(turns, before)),
            history_hits=sum(t.cached_tokens > system_len for t in turns)))
    return rows


def summarize(run: RunResult, system_len: int) -> dict:
    ttfts = sorted(t.ttft_s for t in run.turns)
    prompt = sum(t.prompt_tokens for t in run.turns)
    cached = sum(t.cached_tokens for t in run.turns)
    generated = sum(t.new_tokens for t in run.turns)
    return dict(mean_ttft_s=statistics.fmean(ttfts), p90_ttft_s=ttfts[int(0.9 * (len(ttfts) - 1))],
                hit_rate=cached / prompt if prompt else 0.0, tokens_per_s=generated / run.seconds,
                seconds=run.seconds, requests=len(run.turns), per_turn=per_turn(run, system_len),
                per_node={n: sum(t.node == n for t in run.turns) for n in sorted({t.node for t in run.turns})})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 conversations x 3 turns (about a minute)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1, help="KV-aware and load-only runs, alternating")
    parser.add_argument("--model", default=None, help="model directory (default: models/bench-small)")
    parser.add_argument("--prefix-weight", type=float, default=RoutingConfig().prefix_weight,
                        help="the KV-aware side's --prefix-weight (default: the router's)")
    parser.add_argument("--decode-block-weight", type=float, default=RoutingConfig().decode_block_weight,
                        help="both sides' --decode-block-weight (default: the router's)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="long",
                        help="long: conversations open with a document (default); short: the first pass's "
                             "short-turn chat, which saturates the cluster")
    parser.add_argument("--kv-cache-mib", type=int, default=None, help="each node's KV pool (default: the shape's)")
    parser.add_argument("--long-prefill-token-threshold", type=int, default=LONG_PREFILL_TOKEN_THRESHOLD,
                        help="both sides' nodes' --long-prefill-token-threshold (default "
                             f"{LONG_PREFILL_TOKEN_THRESHOLD}: questions go ahead of documents; 0: off)")
    parser.add_argument("--kv-fetch", choices=FETCH_MODES, default="auto",
                        help="the KV-aware side's nodes' --kv-fetch (default auto: a node fetches a prompt's cached "
                             "prefix from the peer that holds it when that is faster than prefilling it)")
    parser.add_argument("--load-kv-fetch", choices=FETCH_MODES, default="off",
                        help="the load-only side's nodes' --kv-fetch (default off: a fleet with no KV awareness, "
                             "neither in routing nor between nodes; auto: load-only routing over nodes that fetch "
                             "from each other, which isolates what routing alone adds)")
    parser.add_argument("--mean-gap-s", type=float, default=None,
                        help="mean seconds between conversations' arrivals (default: the shape's): the load")
    parser.add_argument("--think-s", type=float, default=None, help="seconds between a reply and the next turn")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.kv_cache_mib is not None and args.kv_cache_mib < 1:
        parser.error("--kv-cache-mib must be positive")
    if args.prefix_weight <= 0:
        parser.error("--prefix-weight must be positive: 0 is the load-only side")
    if args.nodes < 2:
        parser.error("--nodes must be at least 2: routing needs a choice")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    shape = dict(SMOKE if args.smoke else QUICK if args.quick else SHAPES[args.shape])
    if args.mean_gap_s is not None and args.mean_gap_s <= 0:
        parser.error("--mean-gap-s must be positive")
    if args.long_prefill_token_threshold < 0:
        parser.error("--long-prefill-token-threshold must be >= 0")
    if args.think_s is not None and args.think_s < 0:
        parser.error("--think-s must be >= 0")
    shape.update({k: v for k, v in (("mean_gap_s", args.mean_gap_s), ("think_s", args.think_s)) if v is not None})
    args.kv_cache_mib = args.kv_cache_mib or shape["kv_cache_mib"]
    model = Path(args.model) if args.model else (ensure_model("tiny", ROOT / "models" / "bench-tiny") if args.smoke
                                                 else ensure_model())
    conversations = schedule(shape)
    kv_runs, load_runs = [], []
    for _ in range(args.rounds):
        memory, decode = args.kv_cache_mib << 20, args.decode_block_weight
        node_args = ("--long-prefill-token-threshold", str(args.long_prefill_token_threshold))
        kv_runs.append(run_mode(model, conversations, shape, args.nodes, args.prefix_weight, memory, decode,
                                node_args + ("--kv-fetch", args.kv_fetch)))
        load_runs.append(run_mode(model, conversations, shape, args.nodes, 0.0, memory, decode,
                                  node_args + ("--kv-fetch", args.load_kv_fetch)))
    kv = [summarize(r, shape["system_len"]) for r in kv_runs]
    load = [summarize(r, shape["system_len"]) for r in load_runs]
    same_tokens = all(r.replies == kv_runs[0].replies for r in kv_runs + load_runs)

    def mean(rows: list[dict], key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    result = dict(
        dtype="float32",  # the nodes' (pinned above: the shapes' load was set by float32's speed)
        kv_mean_ttft_s=round(mean(kv, "mean_ttft_s"), 4), load_mean_ttft_s=round(mean(load, "mean_ttft_s"), 4),
        ttft_ratio=round(mean(load, "mean_ttft_s") / mean(kv, "mean_ttft_s"), 2),
        kv_p90_ttft_s=round(mean(kv, "p90_ttft_s"), 4), load_p90_ttft_s=round(mean(load, "p90_ttft_s"), 4),
        kv_hit_rate=round(mean(kv, "hit_rate"), 4), load_hit_rate=round(mean(load, "hit_rate"), 4),
        kv_tokens_per_s=round(mean(kv, "tokens_per_s"), 1), load_tokens_per_s=round(mean(load, "tokens_per_s"), 1),
        kv_per_node=kv[0]["per_node"], load_per_node=load[0]["per_node"], identical_replies=same_tokens,
        kv_per_turn=kv[0]["per_turn"], load_per_turn=load[0]["per_turn"], prefix_weight=args.prefix_weight,
        nodes=args.nodes, rounds=args.rounds, shape=shape, model=model.name, kv_cache_mib=args.kv_cache_mib,
        decode_block_weight=args.decode_block_weight, long_prefill_token_threshold=args.long_prefill_token_threshold,
        kv_fetch=args.kv_fetch, load_kv_fetch=args.load_kv_fetch,
    )
    if not args.json:
        print(f"{shape['conversations']} conversations x {shape['turns']} turns over {shape['system_prompts']} "
              f"system prompts of {shape['system_len']} tokens, {args.nodes} nodes, model {model.name}")
        print("| routing | mean TTFT s | p90 TTFT s | prefix hit rate | tokens/s | requests per node |")
        print("|---|---:|---:|---:|---:|---|")
        sides = ((f"KV-aware (prefix weight {args.prefix_weight:g}, --kv-fetch {args.kv_fetch})", kv),
                 (f"load-only (prefix weight 0, --kv-fetch {args.load_kv_fetch})", load))
        for name, rows in sides:
            print(f"| {name} | {mean(rows, 'mean_ttft_s'):.3f} | {mean(rows, 'p90_ttft_s'):.3f} | "
                  f"{mean(rows, 'hit_rate'):.1%} | {mean(rows, 'tokens_per_s'):.1f} | {rows[0]['per_node']} |")
        print("per turn (first round): mean TTFT s / uncached prompt tokens / on the previous turn's node / "
              "found history cached")
        for name, rows in sides:
            print(f"  {name}: " + "; ".join(f"turn {r['turn']}: {r['mean_ttft_s']:.2f} / {r['mean_uncached_tokens']} / "
                                           f"{r['same_node']} / {r['history_hits']}" for r in rows[0]["per_turn"]))
        print(f"mean TTFT ratio (load-only / KV-aware): {result['ttft_ratio']}x (goal >= 2x); "
              f"identical replies: {same_tokens}")
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
