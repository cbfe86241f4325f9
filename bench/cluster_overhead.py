"""The whole cluster against the engine in-process: what the distribution costs.

Same model, same seeded prompts, greedy, a fixed number of new tokens per request, all requests at
once. (a) ``LLMEngine.generate`` in this process with its in-process page table. (b) The same
requests, concurrently, through ``kvfleet router`` to one ``kvfleet compute`` node whose blocks come
from ``kvfleet block-service`` (and an etcd), each a separate process on loopback. Tokens/s is
generated tokens over the wall time from the first request sent to the last token received. The
two sides alternate, best of ``--repeats`` each, so a noisy neighbour hurts both alike (the ratio
of the two medians is printed too).

Also prints the block_service RPCs the node made per generated token (the remote allocator's
batching: allocations, top-ups of the one-block reserve, write-behind commits and releases).

The cluster runs as ``kvfleet up`` runs it: mutual TLS on every internal connection. ``--tls`` adds
a second cluster of the same shape in plaintext (``--insecure-internal``), measured in the same
rounds, and prints ``tls_ratio``: tokens/s with mutual TLS over tokens/s in plaintext.

    python bench/cluster_overhead.py [--quick] [--tls] [--json]   # --json: one object, headline "ratio"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model, seeded_prompts  # noqa: E402

FULL = dict(requests=16, min_len=32, max_len=384, new_tokens=96, repeats=7)
QUICK = dict(requests=8, min_len=32, max_len=256, new_tokens=48, repeats=3)
SMOKE = dict(requests=1, min_len=8, max_len=16, new_tokens=2, repeats=1)  # on models/bench-tiny
BLOCK_SIZE = 64
KV_CACHE_MEMORY = 512 << 20


def run_inprocess(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """``engine.generate`` on a worker thread, as the node runs its engine (``AsyncEngine``'s step
    thread): torch's intra-op (OpenMP) threading is configured per calling thread, and on a small
    machine the main thread's team can be many times slower or faster than a worker's."""
    from kvfleet.core.sampling import SamplingParams

    result: list = []
    worker = threading.Thread(target=lambda: result.append(
        engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))))
    started = time.perf_counter()
    worker.start()
    worker.join()
    elapsed = time.perf_counter() - started
    outs = result[0]
    tokens = sum(len(o.new_token_ids) for o in outs)
    return dict(seconds=elapsed, tokens=tokens, tokens_per_s=tokens / elapsed,
                outputs=[o.new_token_ids for o in outs])


async def _through_router(address: str, prompts: list[list[int]], new_tokens: int) -> dict:
    import grpc

    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()  # a serving client is connected already: the clock is for requests
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(prompt: list[int]) -> list[int]:
            req = inference_pb2.GenerateRequest(
                tokens=inference_pb2.TokenIds(ids=prompt),
                sampling=inference_pb2.SamplingParams(max_tokens=new_tokens, ignore_eos=True))
            tokens: list[int] = []
            async for chunk in stub.Generate(req, metadata=[("authorization", "Bearer sk-gold")], timeout=600):
                tokens.extend(chunk.token_ids)
            return tokens

        started = time.perf_counter()
        outputs = await asyncio.gather(*(one(p) for p in prompts))
        elapsed = time.perf_counter() - started
    tokens = sum(len(o) for o in outputs)
    return dict(seconds=elapsed, tokens=tokens, tokens_per_s=tokens / elapsed, outputs=outputs)


async def _block_rpcs(cluster) -> int:
    from kvfleet.core.identity import Identity
    from kvfleet.v1 import compute_pb2, compute_pb2_grpc

    node_address = f"127.0.0.1:{cluster.nodes['node-0'].port}"
    async with cluster.certs.channel(node_address, Identity.node("node-0")) as channel:
        stats = await compute_pb2_grpc.ComputeStub(channel).Stats(compute_pb2.ComputeStatsRequest(), timeout=30)
    return stats.block_rpcs


def _client_address(cluster, transport: str) -> str:
    router = cluster.router_unix_address if transport == "unix" else cluster.router_address
    if router is None:
        raise SystemExit("the cluster's work directory path is too long for a Unix socket; use --client-transport tcp")
    return router


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller run (under two minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--model", default=None, help="model directory (default: models/bench-small)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="runs of each side, alternating; the best of each counts (default 7, quick 3)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the node's tokens per streamed chunk (default 1: every token at once)")
    parser.add_argument("--client-transport", choices=("unix", "tcp"), default="unix",
                        help="how the client reaches the router: its Unix socket (default, as a client on "
                             "the same machine would) or TCP loopback")
    parser.add_argument("--batch-wait-ms", type=float, default=None,
                        help="the node's --batch-wait-ms (default: the node's own default; 0: off)")
    parser.add_argument("--tls", action="store_true",
                        help="also a plaintext cluster (--insecure-internal) in the same rounds: tls_ratio")
    add_smoke_flag(parser)
    args = parser.parse_args()
    cfg = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    if args.repeats is not None:
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        cfg["repeats"] = args.repeats
    tiny = args.smoke and not args.model
    model = Path(args.model) if args.model else ensure_model("tiny", ROOT / "models" / "bench-tiny") if tiny else ensure_model()
    prompts = seeded_prompts(cfg["requests"], cfg["min_len"], cfg["max_len"], seed=1)

    from kvfleet.cli.local_cluster import LocalCluster
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.event_loop import run as run_loop

    engine = LLMEngine(model, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=KV_CACHE_MEMORY))
    warm = seeded_prompts(cfg["requests"], cfg["min_len"], cfg["max_len"], seed=2)
    run_inprocess(engine, warm, 8)  # warm-up: kernels built and loaded, every batch shape seen
    node_args = ["--stream-interval", str(args.stream_interval)]
    if args.batch_wait_ms is not None:
        node_args += ["--batch-wait-ms", str(args.batch_wait_ms)]
    shape = dict(num_nodes=1, block_size=BLOCK_SIZE, kv_cache_memory=KV_CACHE_MEMORY, log_level="WARNING",
                 compute_args=tuple(node_args))
    inproc, cluster_runs, plain_runs, rpcs = [], [], [], []
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(LocalCluster(model, **shape))
        plain = stack.enter_context(LocalCluster(model, insecure_internal=True, **shape)) if args.tls else None
        routers = {name: _client_address(c, args.client_transport) for name, c in (("tls", cluster), ("plain", plain))
                   if c is not None}
        for router in routers.values():
            run_loop(_through_router(router, warm, 8))  # warm-up
        for _ in range(cfg["repeats"]):
            inproc.append(run_inprocess(engine, prompts, cfg["new_tokens"]))
            before = run_loop(_block_rpcs(cluster))
            cluster_runs.append(run_loop(_through_router(routers["tls"], prompts, cfg["new_tokens"])))
            rpcs.append((run_loop(_block_rpcs(cluster)) - before) / cluster_runs[-1]["tokens"])
            if plain is not None:
                plain_runs.append(run_loop(_through_router(routers["plain"], prompts, cfg["new_tokens"])))
    a = max(inproc, key=lambda r: r["tokens_per_s"])
    b = max(cluster_runs, key=lambda r: r["tokens_per_s"])
    same = all(r["outputs"] == inproc[0]["outputs"] for r in cluster_runs + plain_runs)
    result = dict(
        ratio=b["tokens_per_s"] / a["tokens_per_s"],
        median_ratio=statistics.median(r["tokens_per_s"] for r in cluster_runs)
        / statistics.median(r["tokens_per_s"] for r in inproc),
        inprocess_tokens_per_s=a["tokens_per_s"],
        cluster_tokens_per_s=b["tokens_per_s"],
        block_rpcs_per_token=min(rpcs),
        identical_tokens=same,
        requests=cfg["requests"], new_tokens=cfg["new_tokens"], block_size=BLOCK_SIZE, model=str(model),
        stream_interval=args.stream_interval, batch_wait_ms=args.batch_wait_ms,
        client_transport=args.client_transport, internal="mutual TLS",
        inprocess_runs=[round(r["tokens_per_s"], 1) for r in inproc],
        cluster_runs=[round(r["tokens_per_s"], 1) for r in cluster_runs],
    )
    if plain_runs:
        best_plain = max(r["tokens_per_s"] for r in plain_runs)
        result.update(tls_ratio=b["tokens_per_s"] / best_plain, plaintext_tokens_per_s=best_plain,
                      tls_median_ratio=statistics.median(r["tokens_per_s"] for r in cluster_runs)
                      / statistics.median(r["tokens_per_s"] for r in plain_runs),
                      plaintext_runs=[round(r["tokens_per_s"], 1) for r in plain_runs])
    if args.json:
        print(json.dumps({**result, "dtype": engine_dtype()}))  # the nodes' (auto, resolved here alike)
        return
    print(f"model {model.name}: {cfg['requests']} requests, prompts {cfg['min_len']}-{cfg['max_len']} tokens, "
          f"{cfg['new_tokens']} new tokens each, block size {BLOCK_SIZE}, best of {cfg['repeats']}, "
          f"stream interval {args.stream_interval}, node batch wait "
          f"{'the default' if args.batch_wait_ms is None else f'{args.batch_wait_ms:g} ms'}, "
          f"client → router over {args.client_transport}")
    print(f"  in-process engine     {a['tokens_per_s']:9.1f} tokens/s")
    print(f"  router → 1 node       {b['tokens_per_s']:9.1f} tokens/s   (internal connections: mutual TLS)")
    if plain_runs:
        print(f"  the same, plaintext   {result['plaintext_tokens_per_s']:9.1f} tokens/s   (--insecure-internal)")
        print(f"  tls_ratio (mutual TLS / plaintext): {result['tls_ratio']:.3f}   (goal >= 0.95); "
              f"of the medians: {result['tls_median_ratio']:.3f}")
    print(f"  ratio (cluster / in-process): {result['ratio']:.3f}   (target >= 0.9); "
          f"of the medians: {result['median_ratio']:.3f}")
    print(f"  block_service RPCs per generated token: {result['block_rpcs_per_token']:.3f}")
    print(f"  greedy tokens identical: {same}")


if __name__ == "__main__":
    main()
