"""Time to first token of the first requests after a node starts: cold, random-prefill warm-up,
progressive ramp and KV snapshot restore, beside the field guide's table.

One local cluster (etcd, block_service, router, one ``kvfleet compute`` node, each its own process
on loopback). For each method the node is drained and started again as that method wants it, and
as soon as the router routes to it the same first requests arrive: ``--requests`` prompts, each one
of ``--prefixes`` long shared prefixes plus a short suffix of its own (a system prompt or a document
that every request repeats), greedy, two new tokens. TTFT is from a request's send to its first
token, through the router. The methods:

- **cold**: the node's default start (its minimal warm-up touches every kernel path), then all the
  first requests at once.
- **warm-up** (the guide's random prefill warm-up): ``--warmup random``: before READY the node also
  prefills 4 random prompts as long as these prompts; then all at once.
- **ramp** (the guide's progressive warming): a cold node, but the first requests are admitted
  gradually, in waves of 1, 2, 4, ... requests, each wave once the previous one is answered. This is
  what the router's ``--warmup-s`` does to a new node of a fleet (a share of the traffic growing from
  10% to all of it); with one node the benchmark's client does it, and the waves' later requests
  find the prefixes the first ones computed.
- **snapshot**: ``--kv-snapshot-dir``: the node restores the KV snapshot an earlier run of it wrote
  on drain (after serving these prompts once) before READY; then all at once.

Each method's figure is the mean TTFT of the first requests, median over ``--rounds`` rounds (the
order of the methods rotates between rounds, so a slowing machine hurts all alike); reductions are
``1 - method / cold`` within the same run. Also: seconds from the node's start to READY (what each
method costs at start), and whether the snapshot node's greedy tokens equal the cold node's.

    python bench/cold_start.py [--quick] [--json]     # --json: one object on the last line
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model  # noqa: E402

FULL = dict(prefix=1024, suffix=16, prefixes=2, requests=6, rounds=3)
QUICK = dict(prefix=512, suffix=16, prefixes=2, requests=4, rounds=1)
SMOKE = dict(prefix=32, suffix=8, prefixes=1, requests=1, rounds=1)  # on models/bench-tiny
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
BLOCK_SIZE = 32
KV_CACHE_MEMORY = 512 << 20
METHODS = ("cold", "warmup", "ramp", "snapshot")
GUIDE = {"warmup": "15-20%", "ramp": "25-30%", "snapshot": "80-90%"}  # faster than cold, the field guide's table


def first_prompts(cfg: dict, vocab_size: int) -> list[list[int]]:
    """Request i: prefix ``i % prefixes`` + a suffix of its own (token ids below 32000: ordinary ones)."""
    rng = random.Random(5)
    top = min(vocab_size, 32000)
    prefixes = [[rng.randrange(3, top) for _ in range(cfg["prefix"])] for _ in range(cfg["prefixes"])]
    return [prefixes[i % cfg["prefixes"]] + [rng.randrange(3, top) for _ in range(cfg["suffix"])]
            for i in range(cfg["requests"])]


async def _one(stub, prompt: list[int]) -> tuple[float, list[int]]:
    from kvfleet.v1 import inference_pb2

    req = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=prompt),
                                        sampling=inference_pb2.SamplingParams(max_tokens=2, ignore_eos=True))
    started, ttft, tokens = time.perf_counter(), None, []
    async for chunk in stub.Generate(req, metadata=[("authorization", "Bearer sk-gold")], timeout=900):
        if chunk.token_ids and ttft is None:
            ttft = time.perf_counter() - started
        tokens.extend(chunk.token_ids)
    return ttft, tokens


async def send(address: str, prompts: list[list[int]], waves: bool) -> list[tuple[float, list[int]]]:
    """Each prompt's (TTFT, tokens): all at once, or in waves of 1, 2, 4, ..."""
    import grpc

    from kvfleet.v1 import inference_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = inference_pb2_grpc.InferenceStub(channel)
        if not waves:
            return list(await asyncio.gather(*(_one(stub, p) for p in prompts)))
        results, start, size = [], 0, 1
        while start < len(prompts):
            results += await asyncio.gather(*(_one(stub, p) for p in prompts[start:start + size]))
            start, size = start + size, 2 * size
        return results


def restart_node(cluster, extra: tuple[str, ...]) -> float:
    """Drain node-0 if it runs, start it again with ``extra``; seconds from its start to READY."""
    node = cluster.nodes.get("node-0")
    if node is not None and node.alive():
        cluster.kill("node-0", signal.SIGTERM)
        node.process.wait(timeout=300)
    started = time.perf_counter()
    cluster.add_node("node-0", extra=extra, timeout=900)
    ready = time.perf_counter() - started
    cluster.wait_router(timeout=120)
    return ready


def run_method(cluster, method: str, prompts: list[list[int]], snapshot_args: tuple[str, ...]) -> dict:
    extra = {"cold": (), "ramp": (), "snapshot": snapshot_args,
             "warmup": ("--warmup", "random", "--warmup-tokens", str(len(prompts[0])))}[method]
    ready_s = restart_node(cluster, extra)
    results = asyncio.run(send(cluster.router_address, prompts, waves=method == "ramp"))
    ttfts = [t for t, _ in results]
    return dict(ttft_s=statistics.mean(ttfts), first_ttft_s=ttfts[0], ready_s=ready_s,
                tokens=[tokens for _, tokens in results])


def measure(model: Path, cfg: dict, prompts: list[list[int]], work: Path, runs: dict[str, list[dict]]) -> dict:
    """Every method's runs into ``runs``; returns the snapshot's size in MiB and the seconds its
    restores and writes took (from the node's log)."""
    from kvfleet.cli.local_cluster import LocalCluster

    snapshot_args = ("--kv-snapshot-dir", str(work / "snapshots"), "--kv-snapshot-interval-s", "0")
    cluster = LocalCluster(model, num_nodes=1, work_dir=work / "cluster", block_size=BLOCK_SIZE,
                           kv_cache_memory=KV_CACHE_MEMORY, router_args=("--warmup-s", "0"), metrics=False)
    try:
        cluster.start(timeout=900)  # a loaded 2-core machine has taken minutes to warm SmolLM2 up
        # the snapshot's source: a node that served these prompts once, then drained
        restart_node(cluster, snapshot_args)
        asyncio.run(send(cluster.router_address, prompts, waves=True))
        for r in range(cfg["rounds"]):
            for method in METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]:
                runs[method].append(run_method(cluster, method, prompts, snapshot_args))
        snapshot_file = next((work / "snapshots").glob("*.safetensors"))
        snapshot_mib = snapshot_file.stat().st_size / (1 << 20)
    finally:
        cluster.stop()
    log = (work / "cluster" / "node-0.log").read_text(errors="replace")
    return dict(snapshot_mib=round(snapshot_mib, 1),
                restore_s=[float(s) for s in re.findall(r"restored \d+ of the \d+ blocks .* in ([0-9.]+)s", log)],
                write_s=[float(s) for s in re.findall(r"KV snapshot \(drain\) .* in ([0-9.]+)s", log)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts, fewer requests, one round")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--model", default=None,
                        help="model directory (default: models/smollm2-135m-instruct, else models/bench-small)")
    parser.add_argument("--rounds", type=int, choices=range(1, 11), metavar="1-10", default=None,
                        help="rounds of the four methods (default 3, quick 1)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    cfg = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    cfg["rounds"] = args.rounds or cfg["rounds"]
    model = Path(args.model) if args.model else (ensure_model("tiny", ROOT / "models" / "bench-tiny") if args.smoke else
                                                 SMOLLM2 if (SMOLLM2 / "config.json").is_file() else ensure_model())

    from kvfleet.compute_service.model.config import ModelConfig

    prompts = first_prompts(cfg, ModelConfig.from_dir(model).vocab_size)
    work = Path(tempfile.mkdtemp(prefix="kvfleet-cold-start-"))
    runs: dict[str, list[dict]] = {m: [] for m in METHODS}
    try:
        snapshot = measure(model, cfg, prompts, work, runs)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ttft = {m: statistics.median(r["ttft_s"] for r in runs[m]) for m in METHODS}
    ready = {m: statistics.median(r["ready_s"] for r in runs[m]) for m in METHODS}
    identical = all(r["tokens"] == runs["cold"][0]["tokens"] for m in METHODS for r in runs[m])
    result = dict(
        cold_ttft_s=ttft["cold"], warmup_ttft_s=ttft["warmup"], ramp_ttft_s=ttft["ramp"],
        snapshot_ttft_s=ttft["snapshot"], snapshot_ttft_reduction=1 - ttft["snapshot"] / ttft["cold"],
        warmup_ttft_reduction=1 - ttft["warmup"] / ttft["cold"], ramp_ttft_reduction=1 - ttft["ramp"] / ttft["cold"],
        ready_s={m: round(ready[m], 2) for m in METHODS},
        first_ttft_s={m: round(statistics.median(r["first_ttft_s"] for r in runs[m]), 3) for m in METHODS},
        runs_ttft_s={m: [round(r["ttft_s"], 3) for r in runs[m]] for m in METHODS},
        identical_tokens=identical, **snapshot, model=model.name,
        prefix_tokens=cfg["prefix"], prefixes=cfg["prefixes"], requests=cfg["requests"], rounds=cfg["rounds"],
        block_size=BLOCK_SIZE,
    )
    if not args.json:
        print(f"model {model.name}, block size {BLOCK_SIZE}: {cfg['requests']} first requests on {cfg['prefixes']} "
              f"shared prefixes of {cfg['prefix']} tokens (+{cfg['suffix']} each), median of {cfg['rounds']} "
              f"round(s); snapshot {snapshot['snapshot_mib']} MiB, "
              f"restored in {snapshot['restore_s']} s, written on drain in {snapshot['write_s']} s")
        print("  method     mean TTFT   faster than cold   the guide   start to READY")
        for m in METHODS:
            faster = "" if m == "cold" else f"{1 - ttft[m] / ttft['cold']:.0%}"
            print(f"  {m:<9} {ttft[m]:8.3f} s   {faster:>16}   {GUIDE.get(m, ''):>9}   {ready[m]:10.1f} s")
        print(f"  greedy tokens identical across methods: {identical}")
    print(json.dumps({**result, "dtype": engine_dtype()}))  # the nodes' (auto, resolved here alike)


if __name__ == "__main__":
    main()
