"""A canary's verdicts against a known difference and a control (issue 32), then a promote under load.

Two runs, each on a fresh local cluster of 3 nodes (2 stable + 1 canary, ``kvfleet.cli.canary_cluster``; the
smoke shape 1 stable + 1 canary)
serving the tiny random model, the split at 0.33 of new conversations, the same seeded open-loop
arrivals (distinct conversations, Poisson at ``--rate`` per second):

    known     the canary's batch wait is ``--canary-batch-wait-ms`` (default 300) against the stable
              nodes' 5: an idle canary holds each request's first step that long, so its TTFT must
              come out ``worse``
    control   every node the same configuration: any metric called better or worse is a false verdict

The verdicts are ``kvfleet canary report``'s (the router's own per-request outcomes, the bootstrap of
``kvfleet.cli.canary_verdict``: ``--confidence``, seeded). After the control's measurement, a promote
(the same path as ``kvfleet canary promote`` under ``kvfleet up``: every node drained and restarted,
one at a time) runs while requests keep arriving; every request must end with all its tokens.

Last line, one JSON object: ``known_difference_detected`` (the known run's TTFT p50 verdict is worse),
``control_false_verdicts`` (goal 0), ``promote_lost_requests`` (goal 0), with each run's verdicts.

    python bench/canary.py [--quick] [--json] [--rate R] [--canary-batch-wait-ms MS]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model  # noqa: E402
from bench.disagg import TENANTS  # noqa: E402
from bench.disagg_client import API_KEY  # noqa: E402
from bench.kv_transfer import progress  # noqa: E402
from bench.plan_vs_measured import cpu_model  # noqa: E402

SHARE = 0.33
FULL = dict(requests=360, max_tokens=16, warmup=12, promote_s=2.0, stable=2)
QUICK = dict(requests=150, max_tokens=12, warmup=12, promote_s=2.0, stable=2)
SMOKE = dict(requests=4, max_tokens=2, warmup=2, promote_s=0.5, stable=1)  # a node fewer to start and restart
START_TIMEOUT_S = 300


async def one_request(stub, prompt: list[int], max_tokens: int) -> tuple[int, str]:
    """(tokens received, error status name or "") of one greedy request through the router."""
    import grpc

    from kvfleet.v1 import inference_pb2

    request = inference_pb2.GenerateRequest(tokens=inference_pb2.TokenIds(ids=prompt),
                                            sampling=inference_pb2.SamplingParams(max_tokens=max_tokens,
                                                                                  ignore_eos=True))
    got = 0
    try:
        async for chunk in stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=600):
            got += len(chunk.token_ids)
    except grpc.aio.AioRpcError as e:
        return got, e.code().name
    return got, ""


async def arrivals(address: str, count: int, rate: float, max_tokens: int, seed: int,
                   until: threading.Event | None = None) -> list[tuple[int, str]]:
    """``count`` requests (or, with ``until``, as many as arrive before it is set), Poisson arrivals."""
    import grpc

    from kvfleet.v1 import inference_pb2_grpc

    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        tasks = []
        i = 0
        while (until is None and i < count) or (until is not None and not until.is_set()):
            prompt = [rng.randrange(1, 250) for _ in range(rng.randint(24, 80))]
            tasks.append(asyncio.create_task(one_request(stub, prompt, max_tokens)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def start(model: Path, canary_batch_wait_ms: float | None, stable: int):
    """A started cluster of ``stable`` stable nodes and 1 canary (``canary_batch_wait_ms``: None, the same config)."""
    from kvfleet.cli.canary_cluster import CanaryNodes, CanaryPlan
    from kvfleet.cli.local_cluster import LocalCluster

    cluster = LocalCluster(model, num_nodes=stable, log_level="WARNING", http=False, env={"OMP_NUM_THREADS": "1"},
                           router_args=("--warmup-s", "0"))
    Path(cluster.tenants_file).write_text(TENANTS)
    cluster.start(timeout=START_TIMEOUT_S)
    node = cluster.node if canary_batch_wait_ms is None else \
        dataclasses.replace(cluster.node, batch_wait_ms=canary_batch_wait_ms)
    text = "" if canary_batch_wait_ms is None else f"batch_wait_ms: {canary_batch_wait_ms:g}\n"
    canary = CanaryNodes(cluster, CanaryPlan("bench-canary.yaml", text, node), [f"node-{stable}"])
    canary.start(START_TIMEOUT_S)
    if canary.plan.problem:
        raise SystemExit(f"the canary did not start: {canary.plan.problem}")
    return cluster, canary


def set_share(cluster, share: float) -> None:
    from kvfleet.cli.canary_command import fetch_samples
    from kvfleet.cli.canary_etcd import CanaryStore
    from kvfleet.core.canary import CanarySplit

    async def write() -> None:
        async with CanaryStore(cluster.etcd.url) as store:
            before = await store.split()
            await store.put_split(CanarySplit(share, "", time.time(), before.config_name, before.config_text))

    asyncio.run(write())
    deadline = time.monotonic() + 30
    while (fetch_samples([cluster.metrics_urls["router"]])[0]["split"] or {}).get("share") != share:
        if time.monotonic() > deadline:
            raise SystemExit("the router did not follow the split")
        time.sleep(0.1)


def measure(cluster, args, shape: dict, seed: int) -> dict:
    from kvfleet.cli.canary_command import fetch_samples, report
    from kvfleet.core.event_loop import run as run_loop

    run_loop(arrivals(cluster.router_address, shape["warmup"], 4.0, 4, seed=1000 + seed))  # warm-up, before the split
    set_share(cluster, SHARE)  # a new started_at: the comparison starts now
    results = run_loop(arrivals(cluster.router_address, shape["requests"], args.rate, shape["max_tokens"], seed))
    data = report(fetch_samples([cluster.metrics_urls["router"]]), args.confidence, args.resamples, seed=0)
    data["client_errors"] = sum(bool(err) for _, err in results)
    return data


def promote_under_load(cluster, canary, args, shape: dict) -> dict:
    """Promote while requests arrive; lost = requests that ended with an error or short of their tokens."""
    from kvfleet.core.canary import PROMOTE
    from kvfleet.core.event_loop import run as run_loop

    done = threading.Event()
    results: list = []
    load = threading.Thread(target=lambda: results.extend(run_loop(arrivals(
        cluster.router_address, 0, args.rate, shape["max_tokens"], seed=77, until=done))))
    load.start()
    started = time.monotonic()
    try:
        time.sleep(shape["promote_s"])
        canary.carry_out(PROMOTE, canary_split(cluster))
        time.sleep(shape["promote_s"])
    finally:
        done.set()
        load.join()
    lost = [r for r in results if r[1] or r[0] != shape["max_tokens"]]
    groups = {n: (info.group, info.state.value) for n, info in cluster_nodes(cluster).items()}
    return dict(requests=len(results), lost=len(lost), errors=sorted({e for _, e in lost if e}),
                seconds=round(time.monotonic() - started, 1), nodes_after=groups)


def canary_split(cluster):
    from kvfleet.cli.canary_etcd import CanaryStore

    async def read():
        async with CanaryStore(cluster.etcd.url) as store:
            return await store.split()

    return asyncio.run(read())


def cluster_nodes(cluster):
    from kvfleet.cli.canary_etcd import CanaryStore

    async def read():
        async with CanaryStore(cluster.etcd.url) as store:
            return await store.nodes()

    return asyncio.run(read())


def verdicts(data: dict) -> dict:
    return {m["metric"]: m["verdict"] for m in data["metrics"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    parser.add_argument("--rate", type=float, default=3.0, help="arrivals per second (default 3)")
    parser.add_argument("--canary-batch-wait-ms", type=float, default=300.0)
    parser.add_argument("--confidence", type=float, default=0.95)
    parser.add_argument("--resamples", type=int, default=1000)
    add_smoke_flag(parser)
    args = parser.parse_args()
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    model = ensure_model("tiny", ROOT / "models" / "bench-tiny")
    runs = {}
    promote = {}
    for name, wait in (("known", args.canary_batch_wait_ms), ("control", None)):
        progress(f"{name}: starting {shape['stable']} stable + 1 canary nodes")
        cluster, canary = start(model, wait, shape["stable"])
        try:
            runs[name] = measure(cluster, args, shape, seed=len(runs))
            progress(f"{name}: {verdicts(runs[name])}")
            if name == "control":
                progress("promote under load")
                promote = promote_under_load(cluster, canary, args, shape)
        finally:
            cluster.stop()
    known, control = runs["known"], runs["control"]
    summary = dict(
        known_difference_detected=verdicts(known).get("ttft_p50_s") == "worse",
        control_false_verdicts=sum(v in ("better", "worse") for v in verdicts(control).values()),
        promote_lost_requests=promote.get("lost"),
        known_verdicts=verdicts(known), control_verdicts=verdicts(control),
        known_ttft_p50_s={g: round(v, 4) for g, v in next(m for m in known["metrics"]
                                                           if m["metric"] == "ttft_p50_s")["value"].items()},
        requests={"known": known["requests"], "control": control["requests"]},
        client_errors={"known": known["client_errors"], "control": control["client_errors"]},
        promote=promote, share=SHARE, rate_per_s=args.rate, canary_batch_wait_ms=args.canary_batch_wait_ms,
        confidence=args.confidence, model="bench-tiny (random weights)", dtype=engine_dtype(), cpu=cpu_model(),
        quick=args.quick)
    if not args.json:
        for name in runs:
            print(f"{name}: {json.dumps(verdicts(runs[name]))}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
