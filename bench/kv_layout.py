"""Paged against contiguous KV layout on the guide's mixed workload, same KV memory budget.

The field guide's claim: paging cuts memory fragmentation from 37% to under 9% and fits 3.2x more
concurrent sessions (8 -> 26 per card). Here both layouts run the same requests through the
in-process engine (``LLMEngine`` with its local allocator: the same page table block_service
serves, without the network; the layouts differ only in how a sequence takes blocks,
``kvfleet/compute_service/kv/layout.py``) over a pool of ``--pool-seqs`` contiguous reservations:

    workload   20% of requests at 8K tokens, 80% at 128K (prompt + output), all arriving at once,
               in a seeded order; ``--scale S`` divides every length by S (64: 128 and 2,048 tokens)
    max_model_len = the long length (128K / S); block_size 16; pool = pool_seqs x max_model_len slots

and reports, per layout:

    max_seqs    the most sequences running at once (admitted, holding their blocks)
    waste_frac  reserved but never written, as a share of the pool, averaged over the engine's
                steps: for each running sequence, the slots it holds now at or past the last
                position it will ever write (paged: the unfilled tail of its last block;
                contiguous: max_model_len minus its final length). Slots of a prompt not yet
                prefilled are not waste (they will be written).
    tokens/s    prompt + generated tokens over the run's wall time (and generated alone)
    batch-1     one long request alone: time to first token and per output token (best of a few,
                layouts alternating), where contiguous is meant to win

A tiny random model (``kvfleet make-model --preset tiny``, max_position_embeddings 131072) in a
temporary directory: the layouts' difference is in the bookkeeping, not the arithmetic.

    python bench/kv_layout.py [--quick] [--json] [--scale S] [--requests N] [--pool-seqs N] [--short-share F]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logging.getLogger("kvfleet.block_service").setLevel(logging.ERROR)  # a full pool is this benchmark's normal state
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_smoke_flag, engine_dtype
from bench.plan_vs_measured import cpu_model

LONG, SHORT, OUTPUT = 131072, 8192, 1024   # full-scale lengths: long and short requests, output tokens of each
SHORT_SHARE = 0.2
BLOCK_SIZE = 16
GUIDE = {"paged_waste_frac": 0.09, "contiguous_waste_frac": 0.37, "paged_max_seqs": 26, "contiguous_max_seqs": 8}
FULL = dict(scale=128, requests=40, pool_seqs=8, repeats=5, rounds=2)
QUICK = dict(scale=256, requests=20, pool_seqs=8, repeats=3, rounds=2)
SMOKE = dict(scale=256, requests=4, pool_seqs=2, repeats=1, rounds=1)
BATCH1_OUTPUT = 16  # tokens the batch-1 request generates (at least)


@dataclass(slots=True)
class LayoutRun:
    max_seqs: int
    waste_frac: float         # mean over steps of (held, never written) / pool slots
    peak_waste_frac: float
    written_frac: float       # mean over steps of (written) / pool slots
    tokens_per_s: float       # prompt + generated
    generated_per_s: float
    seconds: float
    steps: int
    preemptions: int
    ttft_ms: float = 0.0      # batch-1
    tpot_ms: float = 0.0


def workload(num_requests: int, scale: int, short_share: float = SHORT_SHARE, seed: int = 0) -> list[list[int]]:
    """Prompts of the mixed workload (each request then generates ``OUTPUT / scale`` tokens)."""
    rng = random.Random(seed)
    output = max(1, OUTPUT // scale)
    num_short = round(short_share * num_requests)
    lengths = [SHORT // scale] * num_short + [LONG // scale] * (num_requests - num_short)
    rng.shuffle(lengths)
    return [[rng.randrange(256) for _ in range(n - output)] for n in lengths]


def make_engine(model_dir: Path, layout: str, scale: int, pool_seqs: int):
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.compute_service.kv.pool import bytes_per_block
    from kvfleet.compute_service.model.config import ModelConfig

    max_len = LONG // scale
    num_blocks = pool_seqs * -(-max_len // BLOCK_SIZE)
    # the pool in the dtype the engine resolves here (bfloat16 on a CPU with native bfloat16)
    memory = num_blocks * bytes_per_block(ModelConfig.from_dir(model_dir), BLOCK_SIZE, engine_dtype())
    config = EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=memory, max_model_len=max_len, kv_layout=layout,
                          max_num_seqs=1024)
    engine = LLMEngine(model_dir, config)
    assert engine.allocator.num_blocks == num_blocks
    # first-call costs (kernels, packing, a full token budget's shapes) out of the timings: the
    # layout measured first would pay them
    warm = -(-config.max_num_batched_tokens // (max_len - 8)) + 1
    engine.generate([[(7 * i + j) % 256 for j in range(max_len - 8)] for i in range(warm)], _sampling(2))
    return engine


def _sampling(max_tokens: int):
    from kvfleet.core.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_workload(engine, prompts: list[list[int]], output: int) -> LayoutRun:
    """All requests at once; per step, who holds what. Waste needs each sequence's final length,
    so the per-step holdings are kept and scored after the run."""
    stats0 = engine.stats()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, _sampling(output))
    held: list[list[tuple[object, int]]] = []  # per step: (sequence, slots it holds)
    written: list[int] = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = list(engine.scheduler.running)
        held.append([(seq, len(seq.block_table) * BLOCK_SIZE) for seq in running])
        written.append(sum(seq.num_computed for seq in running))
    seconds = time.perf_counter() - started
    stats = engine.stats()
    pool = engine.allocator.num_blocks * BLOCK_SIZE
    # a finished sequence's num_computed is the last position it ever wrote, plus one
    waste = [sum(max(0, slots - seq.num_computed) for seq, slots in step) / pool for step in held]
    generated = stats.generated_tokens - stats0.generated_tokens
    computed = stats.prompt_tokens_computed - stats0.prompt_tokens_computed
    return LayoutRun(
        max_seqs=max(len(step) for step in held), waste_frac=sum(waste) / len(waste), peak_waste_frac=max(waste),
        written_frac=sum(written) / len(written) / pool, tokens_per_s=(computed + generated) / seconds,
        generated_per_s=generated / seconds, seconds=seconds, steps=len(held),
        preemptions=stats.num_preemptions - stats0.num_preemptions)


def batch_one(engine, prompt: list[int], output: int) -> tuple[float, float]:
    """(time to first token, seconds per later token) of one request alone."""
    engine.add_request(f"b1-{time.monotonic_ns()}", prompt, _sampling(output))
    started = time.perf_counter()
    first = None
    while engine.has_unfinished_requests():
        if any(out.new_token_ids for out in engine.step()) and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return first - started, (end - first) / max(1, output - 1)


def run(scale: int, num_requests: int, pool_seqs: int, repeats: int, rounds: int,
        short_share: float = SHORT_SHARE) -> dict:
    """Both layouts on the workload ``rounds`` times (paged first, then contiguous first, ...: the
    counts are the same every round, the faster wall time counts), then batch-1 ``repeats`` times."""
    from kvfleet.cli.model_maker import make_model

    if LONG // scale < 4 * BLOCK_SIZE or SHORT // scale < 2 * BLOCK_SIZE:
        raise SystemExit(f"--scale {scale} leaves requests under two blocks; use at most {SHORT // (2 * BLOCK_SIZE)}")
    output = max(1, OUTPUT // scale)
    with tempfile.TemporaryDirectory(prefix="kv-layout-") as tmp:
        model_dir = make_model(Path(tmp) / "tiny-128k", "tiny", seed=0, max_position_embeddings=LONG)
        engines = {layout: make_engine(model_dir, layout, scale, pool_seqs) for layout in ("paged", "contiguous")}
        prompts = workload(num_requests, scale, short_share)
        runs: dict[str, LayoutRun] = {}
        for i in range(rounds):
            for layout in (("paged", "contiguous") if i % 2 == 0 else ("contiguous", "paged")):
                this = run_workload(engines[layout], prompts, output)
                if layout not in runs or this.seconds < runs[layout].seconds:
                    runs[layout] = this
        one_out = max(output, BATCH1_OUTPUT)
        # a long request alone, a new prompt each time (a repeated one would be a prefix hit when paged)
        b1_prompts = [[rng.randrange(256) for _ in range(LONG // scale - one_out)]
                      for rng in (random.Random(1000 + i) for i in range(repeats))]
        timings: dict[str, list[tuple[float, float]]] = {layout: [] for layout in engines}
        for i in range(repeats):  # alternating which goes first
            for layout in (("paged", "contiguous") if i % 2 == 0 else ("contiguous", "paged")):
                timings[layout].append(batch_one(engines[layout], b1_prompts[i], one_out))
        for layout, run_ in runs.items():
            run_.ttft_ms = 1000 * min(t for t, _ in timings[layout])
            run_.tpot_ms = 1000 * min(t for _, t in timings[layout])
        num_blocks = engines["paged"].allocator.num_blocks
    paged, contiguous = runs["paged"], runs["contiguous"]
    result = {
        "scale": scale, "long_tokens": LONG // scale, "short_tokens": SHORT // scale, "output_tokens": output,
        "requests": num_requests, "short_share": short_share, "block_size": BLOCK_SIZE, "pool_blocks": num_blocks,
        "pool_seqs": pool_seqs, "max_model_len": LONG // scale, "batch1_prompt_tokens": len(b1_prompts[0]),
        "batch1_output_tokens": one_out, "rounds": rounds, "batch1_repeats": repeats, "cpu": cpu_model(),
        "dtype": engines["paged"].config.dtype,
        **{f"paged_{k}": round(v, 4) for k, v in asdict(paged).items()},
        **{f"contiguous_{k}": round(v, 4) for k, v in asdict(contiguous).items()},
        "concurrency_ratio": round(paged.max_seqs / contiguous.max_seqs, 3),
        "throughput_ratio": round(paged.tokens_per_s / contiguous.tokens_per_s, 3),
        "ttft_ratio": round(paged.ttft_ms / contiguous.ttft_ms, 3),
        "tpot_ratio": round(paged.tpot_ms / contiguous.tpot_ms, 3),
        "guide": GUIDE,
    }
    return result


def report(r: dict) -> None:
    p, c = "paged_", "contiguous_"
    print(f"mixed workload: {r['requests']} requests, {r['short_share']:.0%} at {r['short_tokens']} tokens and the "
          f"rest at {r['long_tokens']} ({r['output_tokens']} generated each; --scale {r['scale']}), pool "
          f"{r['pool_blocks']} blocks of {r['block_size']} = {r['pool_seqs']} x max_model_len {r['max_model_len']}; "
          f"in-process engine, local allocator; {r['dtype']}, {r['cpu']}")
    print("| layout | most concurrent | waste (mean / peak, of the pool) | written (mean) | tokens/s | "
          "generated/s | engine steps | batch-1 TTFT ms | batch-1 ms/token | preemptions |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, k in (("paged", p), ("contiguous", c)):
        print(f"| {name} | {r[k + 'max_seqs']} | {r[k + 'waste_frac']:.1%} / {r[k + 'peak_waste_frac']:.1%} | "
              f"{r[k + 'written_frac']:.1%} | {r[k + 'tokens_per_s']:.0f} | {r[k + 'generated_per_s']:.1f} | {r[k + 'steps']} | "
              f"{r[k + 'ttft_ms']:.1f} | {r[k + 'tpot_ms']:.2f} | {r[k + 'preemptions']} |")
    g = r["guide"]
    print(f"paged / contiguous: {r['concurrency_ratio']:.2f}x the concurrent sequences (guide: "
          f"{g['contiguous_max_seqs']} -> {g['paged_max_seqs']}, {g['paged_max_seqs'] / g['contiguous_max_seqs']:.1f}x), "
          f"fragmentation {r[c + 'waste_frac']:.1%} -> {r[p + 'waste_frac']:.1%} (guide: "
          f"{g['contiguous_waste_frac']:.0%} -> under {g['paged_waste_frac']:.0%}), {r['throughput_ratio']:.2f}x the "
          f"tokens/s; batch-1 TTFT {r['ttft_ratio']:.2f}x, per token {r['tpot_ratio']:.2f}x contiguous's")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK} (under ~2 minutes here)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument("--scale", type=int, default=None, help="divide every length by this (default 64; quick 256)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--pool-seqs", type=int, default=None, help="pool size in max_model_len reservations (default 8)")
    parser.add_argument("--short-share", type=float, default=SHORT_SHARE,
                        help=f"share of requests at 8K tokens, the rest at 128K (default the guide's {SHORT_SHARE})")
    add_smoke_flag(parser)
    args = parser.parse_args()
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    for name in ("scale", "requests", "pool_seqs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.short_share <= 1:
        parser.error("--short-share must be in [0, 1]")
    result = run(args.scale or shape["scale"], args.requests or shape["requests"], args.pool_seqs or shape["pool_seqs"],
                 shape["repeats"], shape["rounds"], args.short_share)
    report(result)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
