"""KV tiers: prefix hits and TTFT with a host and a disk tier below the pool, and swap against
recompute preemption.

Multi-turn chat over shared system prompts, in process (``LLMEngine`` with its local page table)
on ``models/bench-small`` in float32: each conversation's turn is its whole history (system prompt,
earlier turns, their answers) plus a new user message, the conversations taking turns round-robin,
one request at a time. The working set of prefix blocks is about 4x the hot pool, so without tiers
most of a history is evicted before its conversation comes back. Configurations:

    hot             the pool alone (evicted blocks are lost)
    hot_cold        + a host tier holding the whole working set
    hot_cold_disk   + a host tier of one pool's size and a disk tier holding the rest

For each: the admission lookups by where the block was found (hot, host, disk, miss), the hit rate,
mean TTFT and tokens/s; ratios against ``hot`` in the same run. Then preemption under pressure:
concurrent long sequences in a small pool, preempted victims recomputed against swapped to host
(and ``auto``, which chose by the copy bandwidth and prefill speed measured at start).

Greedy outputs must be identical across configurations (``outputs_equal``).

    python bench/kv_tiers.py [--quick] [--json]
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

from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model
from bench.plan_vs_measured import cpu_model

BLOCK_SIZE = 16
FULL = dict(system_prompts=4, system_tokens=512, conversations=16, turns=4, user_tokens=64, answer_tokens=32,
            preempt_seqs=12, preempt_prompt=128, preempt_output=192)
QUICK = dict(system_prompts=2, system_tokens=128, conversations=8, turns=3, user_tokens=32, answer_tokens=16,
             preempt_seqs=6, preempt_prompt=48, preempt_output=64)
SMOKE = dict(system_prompts=1, system_tokens=32, conversations=2, turns=2, user_tokens=16, answer_tokens=4,
             preempt_seqs=6, preempt_prompt=32, preempt_output=32, token_budget=256)


@dataclass(slots=True)
class TierRun:
    hot: int                  # blocks found in the pool at admission
    host: int                 # promoted from host
    disk: int                 # promoted from disk
    miss: int                 # computed
    hit_rate: float           # (hot + host + disk) / looked up
    mean_ttft_s: float
    tokens_per_s: float       # prompt + generated over the run's wall time
    prompt_tokens_computed: int
    seconds: float


@dataclass(slots=True)
class PreemptRun:
    generated_per_s: float
    preemptions: int
    swapped: int
    prompt_tokens_computed: int
    seconds: float


def conversations(shape: dict, seed: int = 0) -> tuple[list[list[int]], list[list[list[int]]]]:
    """System prompts, and per conversation its user messages (token ids < 256: the byte vocabulary)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(256) for _ in range(shape["system_tokens"])] for _ in range(shape["system_prompts"])]
    users = [[[rng.randrange(256) for _ in range(shape["user_tokens"])] for _ in range(shape["turns"])]
             for _ in range(shape["conversations"])]
    return systems, users


def working_set_blocks(shape: dict) -> int:
    """Distinct full blocks of every conversation's last turn (what a cache would need to hold)."""
    last = shape["system_tokens"] + shape["turns"] * shape["user_tokens"] + (shape["turns"] - 1) * shape["answer_tokens"]
    per_conversation = (last - shape["system_tokens"]) // BLOCK_SIZE
    return shape["system_prompts"] * shape["system_tokens"] // BLOCK_SIZE + shape["conversations"] * per_conversation


def engine(model: Path, pool_blocks: int, budget: int = 4096, **tiers):
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.compute_service.kv.pool import bytes_per_block
    from kvfleet.compute_service.model.config import ModelConfig

    per_block = bytes_per_block(ModelConfig.from_dir(model), BLOCK_SIZE, engine_dtype())  # the dtype auto resolves to
    sized = {k: v * per_block if k in ("kv_host_memory", "kv_disk_bytes") else v for k, v in tiers.items()}
    return LLMEngine(model, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=pool_blocks * per_block,
                                         max_num_batched_tokens=budget, **sized))


def one_request(eng, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Run a request alone: its tokens and its time to first token."""
    from kvfleet.core.sampling import SamplingParams

    start = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens: list[int] = []
    ttft = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - start
            tokens += out.new_token_ids
    return tokens, ttft


def run_chat(eng, shape: dict) -> tuple[TierRun, list[list[int]]]:
    systems, users = conversations(shape)
    history = [list(systems[c % len(systems)]) for c in range(shape["conversations"])]
    ttfts, outputs, total_tokens = [], [], 0
    start = time.perf_counter()
    for turn in range(shape["turns"]):
        for c in range(shape["conversations"]):
            history[c] += users[c][turn]
            answer, ttft = one_request(eng, f"c{c}-t{turn}", history[c], shape["answer_tokens"])
            history[c] += answer
            ttfts.append(ttft)
            outputs.append(answer)
            total_tokens += len(history[c])
    seconds = time.perf_counter() - start
    stats = eng.stats()
    found = stats.lookups
    looked_up = found.hot + found.host + found.disk + found.miss
    run = TierRun(found.hot, found.host, found.disk, found.miss, (looked_up - found.miss) / max(looked_up, 1),
                  sum(ttfts) / len(ttfts), total_tokens / seconds, stats.prompt_tokens_computed, seconds)
    return run, outputs


def run_preemption(model: Path, shape: dict, mode: str) -> tuple[PreemptRun, list[list[int]]]:
    from kvfleet.core.sampling import SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(shape["preempt_prompt"] + 8 * i)] for i in range(shape["preempt_seqs"])]
    per_seq = -(-(shape["preempt_prompt"] + shape["preempt_output"]) // BLOCK_SIZE)
    pool = per_seq * shape["preempt_seqs"] // 3  # a third of what they grow to: preemption is the normal state
    host = per_seq * shape["preempt_seqs"] * 2
    tiers = {} if mode == "recompute" else dict(kv_host_memory=host, preemption_mode=mode)
    eng = engine(model, pool, shape.get("token_budget", 4096), **tiers)
    start = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=shape["preempt_output"], ignore_eos=True))
    seconds = time.perf_counter() - start
    stats = eng.stats()
    generated = sum(len(o.new_token_ids) for o in outs)
    return (PreemptRun(generated / seconds, stats.num_preemptions, stats.num_swapped, stats.prompt_tokens_computed,
                       seconds), [o.new_token_ids for o in outs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    add_smoke_flag(parser)
    args = parser.parse_args()
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    model = ensure_model("tiny", ROOT / "models" / "bench-tiny") if args.smoke else ensure_model()  # smoke: models/bench-tiny
    working = working_set_blocks(shape)
    longest = -(-(shape["system_tokens"] + shape["turns"] * (shape["user_tokens"] + shape["answer_tokens"])) // BLOCK_SIZE)
    pool = max(working // 4, longest + 1)
    print(f"{cpu_model()}; {model.name} {engine_dtype()}, block {BLOCK_SIZE}; working set {working} blocks, hot pool {pool} "
          f"({working / pool:.1f}x)", file=sys.stderr)
    results: dict = {"shape": shape, "working_set_blocks": working, "hot_pool_blocks": pool, "cpu": cpu_model(),
                     "dtype": engine_dtype()}
    outputs = {}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") as disk:
        configs = {"hot": {}, "hot_cold": dict(kv_host_memory=working),
                   "hot_cold_disk": dict(kv_host_memory=pool, kv_disk_dir=disk, kv_disk_bytes=working)}
        for name, tiers in configs.items():
            run, outputs[name] = run_chat(engine(model, pool, shape.get("token_budget", 4096), **tiers), shape)
            results[name] = asdict(run)
            print(f"{name:14s} hit {run.hit_rate:6.1%} (hot {run.hot}, host {run.host}, disk {run.disk}, miss {run.miss})"
                  f"  mean TTFT {run.mean_ttft_s:.3f}s  {run.tokens_per_s:.0f} tok/s", file=sys.stderr)
    for name in ("hot_cold", "hot_cold_disk"):
        results[name]["ttft_ratio_vs_hot"] = results["hot"]["mean_ttft_s"] / results[name]["mean_ttft_s"]
        results[name]["throughput_ratio_vs_hot"] = results[name]["tokens_per_s"] / results["hot"]["tokens_per_s"]
    chat_equal = outputs["hot"] == outputs["hot_cold"] == outputs["hot_cold_disk"]
    preempt_outputs = {}
    results["preemption"] = {}
    for mode in ("recompute", "swap", "auto"):
        run, preempt_outputs[mode] = run_preemption(model, shape, mode)
        results["preemption"][mode] = asdict(run)
        print(f"preemption {mode:9s} {run.generated_per_s:.1f} generated tok/s, {run.preemptions} preemptions "
              f"({run.swapped} swapped), {run.prompt_tokens_computed} prompt tokens computed", file=sys.stderr)
    results["preemption"]["swap_vs_recompute_throughput"] = (results["preemption"]["swap"]["generated_per_s"]
                                                             / results["preemption"]["recompute"]["generated_per_s"])
    results["outputs_equal"] = chat_equal and (preempt_outputs["recompute"] == preempt_outputs["swap"]
                                               == preempt_outputs["auto"])
    for name in ("hot_cold", "hot_cold_disk"):
        print(f"{name}: TTFT {results[name]['ttft_ratio_vs_hot']:.2f}x better, throughput "
              f"{results[name]['throughput_ratio_vs_hot']:.2f}x of hot only", file=sys.stderr)
    print(f"swap/recompute throughput {results['preemption']['swap_vs_recompute_throughput']:.2f}x; "
          f"outputs equal: {results['outputs_equal']}", file=sys.stderr)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
