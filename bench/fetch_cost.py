"""A small KV fetch's fixed cost (issue 33): a 50-block and a 512-block fetch, end to end and by
phase, with both nodes idle, with the holder decoding a stream, and with both decoding.

    child process   the holder: a node's ``Compute`` server under mutual TLS, one intra-op thread,
                    bench-small's dimensions (``models/bench-small``), its pool holding a tenant's
                    chain of committed blocks; decoding: a greedy stream steps its engine throughout
    this process    the receiver: ``fetch_blocks`` of the chain's first N blocks into its own pool
                    (one intra-op thread, every page of it touched first, as in a node that has
                    served a while), over the channel its ``PeerDirectory`` keeps to the holder;
                    decoding: a stream of its own steps its engine throughout. Its pool is flushed
                    before each fetch, so every fetch moves N blocks

A fetch is timed from the call to its answer; its phases are the receiver's (``Fetched``): open
(the pool's blocks taken: a wait for the engine's step in progress), stream (asked, the holder's
copy, the wire, the checks), commit (written, committed, released: another step's wait). Each
case's figure is the median of ``--repeats`` fetches and the best of them; the first fetch of each
size is left out (the first channel, the first touch of buffers). Blocks of 16 tokens, float32
KV: a bench-small block is 256 KiB, so 50 blocks are a conversation's ~13 MB history
(``bench/routing.py``). Main before the kept channel dials one per fetch (the script still runs).

    python bench/fetch_cost.py [--repeats 7] [--sizes 50,512] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import BENCH_MODEL, add_smoke_flag, ensure_model  # noqa: E402
from bench.kv_wire import HOLDER, RECEIVER, TENANT, chain, cpu, fill, flush, holder_address, holder_child, serving  # noqa: E402
from kvfleet.compute_service.engine.async_engine import AsyncEngine  # noqa: E402
from kvfleet.compute_service.engine.config import EngineConfig  # noqa: E402
from kvfleet.compute_service.engine.llm_engine import LLMEngine  # noqa: E402
from kvfleet.compute_service.kv.pool import bytes_per_block  # noqa: E402
from kvfleet.compute_service.model.config import ModelConfig  # noqa: E402
from kvfleet.compute_service.node.kv_fetch import fetch_blocks  # noqa: E402
from kvfleet.core.sampling import SamplingParams  # noqa: E402

BLOCK_SIZE = 16
STREAM_PROMPT = 64     # the holder's decoding stream: prompt tokens, then greedy tokens until restarted
STREAM_TOKENS = 1024
SPARE_BLOCKS = 160     # each pool beyond the chain: a stream's blocks
PHASES = ("open_s", "stream_s", "commit_s")  # the receiver's, from its Fetched
CASES = {"idle": (False, False), "holder_decoding": (True, False), "both_decoding": (True, True)}  # holder, receiver


def make_engine(blocks: int) -> LLMEngine:
    per = bytes_per_block(ModelConfig.from_dir(BENCH_MODEL), BLOCK_SIZE, "float32")
    return LLMEngine(BENCH_MODEL, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, kv_cache_dtype="float32",
                                               kv_cache_memory=(blocks + SPARE_BLOCKS) * per,
                                               preemption_mode="recompute"))


async def decode_forever(engine: AsyncEngine, steps: list[float]) -> None:
    """A greedy stream on the holder, started again whenever it ends; ``steps``: each output's time."""
    n = 0
    while True:
        n += 1
        async for _ in engine.generate(f"stream-{n}", list(range(1, STREAM_PROMPT + 1)),
                                       SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True)):
            steps.append(time.perf_counter())


async def serve_holder(certs_dir: Path, blocks: int, decoding: bool) -> None:
    """The child: fill, serve under TLS, print the port; then per line of stdin, the stream's
    median step since the last line, until stdin closes."""
    engine = make_engine(blocks)
    fill(engine, chain(blocks, BLOCK_SIZE))
    async with serving(certs_dir, engine, BLOCK_SIZE) as holder:
        steps: list[float] = []
        stream = asyncio.create_task(decode_forever(holder, steps)) if decoding else None
        while await asyncio.to_thread(sys.stdin.readline):
            gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
            print(json.dumps({"step_s": statistics.median(gaps) if gaps else None}), flush=True)
            steps.clear()
        if stream is not None:
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream


async def fetch_runs(address: str, engine: AsyncEngine, blocks: list, sizes: list[int], repeats: int, child,
                     receiver_decoding: bool) -> dict:
    """Per fetch size: the fetches' seconds (median, best, each) and the receiver's phases (medians)."""
    from kvfleet.compute_service.node.peer_directory import PeerDirectory
    from kvfleet.core.membership import NodeInfo, NodeState

    peers = PeerDirectory(RECEIVER)  # the channel kept between fetches, as a node keeps it
    peers.apply(HOLDER, NodeInfo(HOLDER, address, "bench-small", len(blocks), BLOCK_SIZE, NodeState.READY))
    kept = dict(peers=peers) if "peers" in inspect.signature(fetch_blocks).parameters else {}  # main before it: none
    steps: list[float] = []
    stream = asyncio.create_task(decode_forever(engine, steps)) if receiver_decoding else None
    hashes, out = [b.block_hash for b in blocks], {}
    for n in sizes:
        runs, holder_steps = [], []
        for r in range(repeats + 1):
            await engine.call(lambda e: flush(e, e.allocator.stats().num_free + e.allocator.stats().num_cached))
            started = time.perf_counter()
            got = await fetch_blocks(address, HOLDER, TENANT, hashes[:n], engine, deadline_s=60, **kept)
            seconds = time.perf_counter() - started
            if got.blocks != n or got.reason is not None:
                raise SystemExit(f"the fetch of {n} blocks stopped short: {got}")
            child.stdin.write("\n")
            child.stdin.flush()
            holder_steps.append(json.loads(child.stdout.readline())["step_s"])
            if r:  # the first: warm-up (the first channel, the first touch of buffers)
                runs.append(dict(seconds=seconds, **{k: getattr(got, k, None) for k in PHASES}))
        out[str(n)] = dict(seconds=round(statistics.median(r["seconds"] for r in runs), 4),
                           best_s=round(min(r["seconds"] for r in runs), 4), mb=round(got.bytes / 1e6, 1),
                           phases={k: round(statistics.median(r[k] for r in runs), 4) for k in PHASES
                                   if runs[0][k] is not None},
                           all_seconds=[round(r["seconds"], 4) for r in runs],
                           holder_step_s=_median(holder_steps[1:]))
    if stream is not None:
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stream
        await engine.call(lambda e: None)  # after its abort: no step's outputs come to a closed loop
        out["receiver_step_s"] = _median([b - a for a, b in zip(steps, steps[1:], strict=False)])
    await peers.close()
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 4) if values else None


def run(sizes: list[int], repeats: int, holder_decoding: bool, receiver_decoding: bool) -> dict:
    blocks_n = max(sizes)
    args = ["--blocks", str(blocks_n), *(["--decoding"] if holder_decoding else [])]
    with holder_child(__file__, args, "fetch-cost-") as (certs_dir, child):
        receiver = make_engine(blocks_n)
        receiver.runner.kv_cache.zero_()  # every page touched, as in a node that has served a while
        address = holder_address(certs_dir, child)
        engine = AsyncEngine(receiver)
        try:
            return asyncio.run(fetch_runs(address, engine, chain(blocks_n, BLOCK_SIZE), sizes, repeats, child,
                                          receiver_decoding))
        finally:
            engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--sizes", default="50,512", help="blocks per fetch, comma-separated")
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    parser.add_argument("--serve-holder", type=Path, metavar="CERTS", help=argparse.SUPPRESS)
    parser.add_argument("--blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--decoding", action="store_true", help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    if args.serve_holder is not None:
        asyncio.run(serve_holder(args.serve_holder, args.blocks, args.decoding))
        return
    ensure_model()
    sizes = [4, 8] if args.smoke else [int(s) for s in args.sizes.split(",")]
    if args.smoke:
        args.repeats = 1
    load = os.getloadavg()[0]
    result = {case: run(sizes, args.repeats, *decoding) for case, decoding in CASES.items()}
    result.update(dtype="float32", cpu=cpu(), load_before=round(load, 2), load_after=round(os.getloadavg()[0], 2))
    if not args.json:
        for case in CASES:
            for n, row in result[case].items():
                if isinstance(row, dict):
                    print(f"{case}, {n} blocks ({row['mb']} MB): median {row['seconds']:.3f} s, best "
                          f"{row['best_s']:.3f} s; {row['phases']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
