"""A tenant's cache under another tenant's flood, per eviction policy (issue 30).

Tenant A runs multi-turn conversations over 4 system prompts at a steady rate (a conversation every
``conv_gap_s``, each turn's prompt the whole history so far); tenant B, alone in the second phase,
floods unique long prompts from ``b_concurrency`` closed loops into the same two nodes, several times
A's prompt-token rate. Each policy (``lru``, ``fair``, ``value``, ``fair+value``) gets a fresh local
cluster (the tiny model, float32, block 16, a small KV pool per node so that the flood fills it); A has
a share of the cache (``cache_share_mib``), B none. Per policy:

    a_hit_rate_alone / a_hit_rate_flooded   A's cached / prompt tokens (each request's usage), for the
                                            requests sent in the measured window of each phase
    a_mean_ttft_alone_s / _flooded_s        A's mean time to first token in those windows
    b_tokens_per_s                          B's prompt + generated tokens per second of its flood
    a_hit_rate_kept                         flooded / alone
    b_to_a_token_rate                       B's prompt tokens sent per second / A's, in the flood
    evictions                               block_service's evictions per tenant and reason

The last line of ``--json`` is one object: ``policies`` (name → the figures above), ``cpu``, ``dtype``.

    python bench/tenant_fairness.py [--quick] [--json] [--rounds N] [--policies lru,fair,...]
                                    [--kv-cache-mib M] [--a-share-mib S] [--model DIR]

With ``--rounds N`` every policy runs N times, the order rotated each round (this machine's other
work drifts), and each figure is the mean of its rounds (``rounds`` keeps each round's).

Each node runs one intra-op thread (OMP_NUM_THREADS=1: two nodes share a 2-core machine) with
``--long-prefill-token-threshold 128`` (A's short turns are not queued behind B's whole prefills),
the router's cold-start ramp off; internal connections in plaintext (a benchmark).
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

from bench.common import add_smoke_flag, ensure_model  # noqa: E402
from bench.plan_vs_measured import cpu_model  # noqa: E402

POLICIES = ("lru", "fair", "value", "fair+value")
# A: 4 system prompts of 256 tokens, conversations of 4 turns; B: 768-token unique prompts from 4
# loops. A node's pool of 8 MiB is 256 blocks of 16 tokens (the tiny model in float32: 2 KiB per
# token), A's share 3 MiB (96 blocks): about A's working set per node (its system prompts and the live
# conversations'), which leaves room for B's requests in flight (4 x 48 blocks over the two nodes).
FULL = dict(system_prompts=4, system_len=256, user_len=(24, 48), reply=8, turns=4, conv_gap_s=2.0, think_s=1.0,
            b_prompt_len=768, b_reply=2, b_concurrency=4, alone_s=60, flooded_s=90, settle_s=20,
            kv_cache_mib=8, a_share_mib=3)
QUICK = dict(FULL, alone_s=30, flooded_s=40, settle_s=10)
SMOKE = dict(FULL, alone_s=2, flooded_s=2, settle_s=0.5, turns=2, think_s=0.2, system_prompts=1, b_concurrency=2)  # one policy
# the tiny model (the tests' and the demo's preset): its prefill is fast enough on a CPU for B to
# flood at several times A's token rate; ``--model models/bench-small`` for a bigger one (size the
# pool again: 16 KiB per token)
BENCH_TINY = Path(__file__).resolve().parent.parent / "models" / "bench-tiny"
BLOCK_SIZE = 16
LONG_PREFILL_TOKEN_THRESHOLD = 128
VOCAB = 256
KEYS = {"a": "sk-a", "b": "sk-b"}


@dataclass(slots=True)
class Sent:
    tenant: str
    sent_s: float          # from the run's start
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    new_tokens: int


@dataclass(slots=True)
class Run:
    sent: list[Sent] = field(default_factory=list)
    evictions: dict[str, dict[str, int]] = field(default_factory=dict)


def tenants_yaml(shape: dict) -> str:
    quota = shape["kv_cache_mib"]
    return ("tenants:\n"
            f"  - {{name: a, api_key: {KEYS['a']}, quota_mib: {quota}, cache_share_mib: {shape['a_share_mib']}, "
            "paid_level: 1, max_concurrent: 64}\n"
            f"  - {{name: b, api_key: {KEYS['b']}, quota_mib: {quota}, paid_level: 1, max_concurrent: 64}}\n")


async def _drive(address: str, shape: dict, seed: int) -> list[Sent]:
    import grpc

    from kvfleet.v1 import inference_pb2, inference_pb2_grpc

    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(shape["system_len"])] for _ in range(shape["system_prompts"])]
    end_s = shape["alone_s"] + shape["flooded_s"]
    sent: list[Sent] = []
    async with grpc.aio.insecure_channel(address) as channel:
        await channel.channel_ready()
        stub = inference_pb2_grpc.InferenceStub(channel)
        t0 = time.perf_counter()

        async def request(tenant: str, prompt: list[int], reply: int) -> list[int]:
            msg = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=prompt),
                                                sampling=inference_pb2.SamplingParams(max_tokens=reply, ignore_eos=True))
            start, first, tokens, usage = time.perf_counter(), None, [], None
            async for chunk in stub.Generate(msg, metadata=[("authorization", f"Bearer {KEYS[tenant]}")], timeout=600):
                if chunk.token_ids and first is None:
                    first = time.perf_counter()
                tokens.extend(chunk.token_ids)
                if chunk.HasField("usage"):
                    usage = chunk.usage
            sent.append(Sent(tenant, start - t0, first - start, usage.prompt_tokens, usage.cached_tokens, len(tokens)))
            return tokens

        async def conversation(index: int, crng: random.Random) -> None:
            history = list(systems[index % len(systems)])
            for _ in range(shape["turns"]):
                if time.perf_counter() - t0 >= end_s:
                    return
                history += [crng.randrange(VOCAB) for _ in range(crng.randint(*shape["user_len"]))]
                history += await request("a", history, shape["reply"])
                await asyncio.sleep(shape["think_s"])

        async def tenant_a() -> None:
            tasks, index = [], 0
            while (due := index * shape["conv_gap_s"]) < end_s:
                await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
                tasks.append(asyncio.create_task(conversation(index, random.Random(seed * 1000 + index))))
                index += 1
            await asyncio.gather(*tasks)

        async def tenant_b(loop: int) -> None:
            brng = random.Random(seed * 7 + loop)
            await asyncio.sleep(shape["alone_s"])
            while time.perf_counter() - t0 < end_s:
                await request("b", [brng.randrange(VOCAB) for _ in range(shape["b_prompt_len"])], shape["b_reply"])

        await asyncio.gather(tenant_a(), *(tenant_b(i) for i in range(shape["b_concurrency"])))
    return sent


async def _evictions(address: str) -> dict[str, dict[str, int]]:
    from kvfleet.block_service.client import BlockManagerClient

    async with BlockManagerClient(address, timeout_s=10) as client:
        _, tenants = await client.stats()
    out: dict[str, dict[str, int]] = {}
    for t in tenants:
        for reason, n in t.counters.evictions.items():
            by = out.setdefault(t.tenant or "?", {})
            by[reason] = by.get(reason, 0) + n
    return out


def run_policy(model: Path, policy: str, shape: dict, work: Path) -> Run:
    from kvfleet.block_service.settings import EvictionSettings
    from kvfleet.cli.local_cluster import LocalCluster
    from kvfleet.core.event_loop import run as run_loop

    work.mkdir(parents=True, exist_ok=True)
    tenants = work / "tenants.yaml"
    tenants.write_text(tenants_yaml(shape))
    node_args = ("--long-prefill-token-threshold", str(LONG_PREFILL_TOKEN_THRESHOLD))
    with LocalCluster(model, num_nodes=2, tenants_file=tenants, work_dir=work / "cluster", block_size=BLOCK_SIZE,
                      kv_cache_memory=shape["kv_cache_mib"] << 20, log_level="WARNING",
                      router_args=("--warmup-s", "0"), env={"OMP_NUM_THREADS": "1"}, dtype="float32", http=False,
                      metrics=False, compute_args=node_args, insecure_internal=True,
                      eviction=EvictionSettings(policy)) as cluster:
        warm = dict(shape, alone_s=0, flooded_s=0.1, turns=1, b_concurrency=2, b_prompt_len=64, b_reply=2)
        run_loop(_drive(cluster.router_address, warm, seed=99))  # kernels built and loaded on both nodes
        run = Run(run_loop(_drive(cluster.router_address, shape, seed=0)))
        run.evictions = run_loop(_evictions(cluster.block_service_address))
    return run


def figures(run: Run, shape: dict) -> dict:
    settle, alone_end, end = shape["settle_s"], shape["alone_s"], shape["alone_s"] + shape["flooded_s"]
    a_alone = [s for s in run.sent if s.tenant == "a" and settle <= s.sent_s < alone_end]
    a_flooded = [s for s in run.sent if s.tenant == "a" and alone_end + settle <= s.sent_s < end]
    b = [s for s in run.sent if s.tenant == "b"]

    def hit_rate(rows: list[Sent]) -> float:
        prompt = sum(s.prompt_tokens for s in rows)
        return sum(s.cached_tokens for s in rows) / prompt if prompt else 0.0

    b = [s for s in b if alone_end + settle <= s.sent_s < end]  # B's loops are closed: sent at its rate
    window = end - alone_end - settle
    a_rate = sum(s.prompt_tokens for s in a_flooded) / window
    b_rate = sum(s.prompt_tokens for s in b) / window
    alone, flooded = hit_rate(a_alone), hit_rate(a_flooded)
    return dict(
        a_hit_rate_alone=round(alone, 4), a_hit_rate_flooded=round(flooded, 4),
        a_mean_ttft_alone_s=round(statistics.fmean(s.ttft_s for s in a_alone), 4) if a_alone else None,
        a_mean_ttft_flooded_s=round(statistics.fmean(s.ttft_s for s in a_flooded), 4) if a_flooded else None,
        b_tokens_per_s=round(sum(s.prompt_tokens + s.new_tokens for s in b) / window, 1),
        a_hit_rate_kept=round(flooded / alone, 3) if alone else None,
        b_to_a_token_rate=round(b_rate / a_rate, 2) if a_rate else None,
        a_requests=[len(a_alone), len(a_flooded)], b_requests=len(b), evictions=run.evictions,
    )


def mean_figures(rows: list[dict]) -> dict:
    """The rounds' mean of each figure (the first round's evictions and counts), and every round's."""
    out = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, float) and all(isinstance(r[key], float) for r in rows):
            out[key] = round(statistics.fmean(r[key] for r in rows), 4)
    if len(rows) > 1:
        out["rounds"] = rows
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases (a few minutes for the four policies)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: all four)")
    parser.add_argument("--rounds", type=int, default=1, help="runs per policy, the order rotated each round")
    parser.add_argument("--kv-cache-mib", type=int, default=None, help="each node's KV pool (default: the shape's)")
    parser.add_argument("--a-share-mib", type=float, default=None, help="A's cache_share_mib (default: the shape's)")
    parser.add_argument("--model", default=None, help="model directory (default: models/bench-tiny, made if missing)")
    parser.add_argument("--work-dir", default=None, help="the clusters' logs (default: a temporary directory)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.policies, args.rounds = "fair", 1
    policies = [p for p in args.policies.split(",") if p]
    if unknown := [p for p in policies if p not in POLICIES]:
        parser.error(f"unknown policies {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    shape = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    shape.update({k: v for k, v in (("kv_cache_mib", args.kv_cache_mib), ("a_share_mib", args.a_share_mib))
                  if v is not None})
    model = Path(args.model) if args.model else ensure_model("tiny", BENCH_TINY)
    import tempfile

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="kvfleet-fairness-"))
    started = time.perf_counter()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    rounds: dict[str, list[dict]] = {p: [] for p in policies}
    for r in range(args.rounds):
        for p in policies[r % len(policies):] + policies[:r % len(policies)]:
            rounds[p].append(figures(run_policy(model, p, shape, work / f"{p.replace('+', '_')}-{r}"), shape))
    results = {p: mean_figures(rows) for p, rows in rounds.items()}
    out = dict(policies=results, cpu=cpu_model(), dtype="float32", model=model.name, shape=shape,
               seconds=round(time.perf_counter() - started, 1))
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{cpu_model()}; {model.name} float32, 2 nodes of {shape['kv_cache_mib']} MiB, A's share "
              f"{shape['a_share_mib']} MiB, B none")
        print("| policy | A hit alone | A hit flooded | kept | A TTFT alone s | A TTFT flooded s | B tokens/s | B/A rate |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for p, r in results.items():
            print(f"| {p} | {r['a_hit_rate_alone']:.1%} | {r['a_hit_rate_flooded']:.1%} | {r['a_hit_rate_kept']} | "
                  f"{r['a_mean_ttft_alone_s']} | {r['a_mean_ttft_flooded_s']} | {r['b_tokens_per_s']} | "
                  f"{r['b_to_a_token_rate']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
