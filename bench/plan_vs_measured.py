"""``kvfleet plan``'s decode estimate for this CPU against the engine's measured decode tokens/s.

The plan's roofline for ``--device cpu`` uses this machine's memory bandwidth, measured at the
start (a copy of arrays larger than the caches), and the model's shapes: a decode step reads the
weights once and every sequence's KV. The engine then decodes batches of the same size at the same
context, in process; the figure is measured / estimated (1.0: the roofline is met; below: the
engine loses time the roofline does not count — Python, kernel launches, attention at small sizes).

The engine runs on one thread by default (``--threads``): the bandwidth probe copies on one, and
on a shared machine two OpenMP threads that wait for each other at every barrier lose most of
their time to other processes (measured here: 2.4 tokens/s on two threads, 18.5 on one, under a
load average of 6 on 2 cores).

    python bench/plan_vs_measured.py [--quick] [--json] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, engine_dtype, ensure_model, seeded_prompts  # noqa: E402

FULL = dict(preset="small", batches=(1, 8, 32), prompt_len=256, decode_steps=32)
WARM_UP = 4
QUICK = dict(preset="tiny", batches=(1, 8), prompt_len=64, decode_steps=16)
SMOKE = dict(preset="tiny", batches=(2,), prompt_len=16, decode_steps=4)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return f"{fields['Model name'].strip()}, {fields['CPU(s)'].strip()} CPUs"
    except (OSError, subprocess.CalledProcessError, KeyError):
        return platform.processor() or "unknown CPU"


def measure_decode(model: Path, batch: int, prompt_len: int, decode_steps: int) -> tuple[float, float]:
    """(decode tokens/s, mean context during the timed steps): ``batch`` prompts prefilled first,
    ``WARM_UP`` decode steps, then ``decode_steps`` steps of one token for each, timed one by one;
    the median step counts (a shared machine's stalls land in a few steps, not in every one)."""
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.sampling import SamplingParams

    engine = LLMEngine(model, EngineConfig(block_size=64, kv_cache_memory=1 << 30, max_num_seqs=batch,
                                           max_num_batched_tokens=max(2048, batch * prompt_len)))
    sampling = SamplingParams(max_tokens=WARM_UP + decode_steps + 4, ignore_eos=True)
    for i, prompt in enumerate(seeded_prompts(batch, prompt_len, prompt_len, seed=batch)):
        engine.add_request(f"r{i}", prompt, sampling)
    while engine.stats().generated_tokens < batch:  # prefill: every sequence has its first token
        engine.step()
    for _ in range(WARM_UP):  # the first steps at a new batch shape build their matmul primitives
        engine.step()
    times = []
    for _ in range(decode_steps):
        before = engine.stats().generated_tokens
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        assert engine.stats().generated_tokens - before == batch, "a timed step was not a full decode step"
        times.append(elapsed)
    return batch / statistics.median(times), prompt_len + 1 + WARM_UP + decode_steps / 2

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model, two batch sizes (seconds)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the engine (default 1)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.threads < 1:
        parser.error(f"--threads must be at least 1, got {args.threads}")
    setup = SMOKE if args.smoke else QUICK if args.quick else FULL

    import torch

    torch.set_num_threads(args.threads)

    from kvfleet.cli.planning.capacity import CapacityRequest, capacity
    from kvfleet.cli.planning.cpu_device import measured_cpu
    from kvfleet.cli.planning.model_dir import shape_from_dir
    from kvfleet.cli.planning.sizing import decode_step

    cpu = measured_cpu()
    model = ensure_model(setup["preset"], ROOT / "models" / f"bench-{setup['preset']}")
    shape = shape_from_dir(model)
    kv_per_token = capacity(shape, cpu, CapacityRequest(context=setup["prompt_len"], block_size=64)).kv_bytes_per_token
    rows = []
    for batch in setup["batches"]:
        measured, context = measure_decode(model, batch, setup["prompt_len"], setup["decode_steps"])
        step, bound = decode_step(shape, cpu, 1, kv_per_token, batch, round(context))
        rows.append(dict(batch=batch, context=round(context), estimated_tokens_per_s=batch / step, bound=bound,
                         measured_tokens_per_s=measured, ratio=measured * step / batch))
    result = dict(cpu=cpu_model(), dtype=engine_dtype(), threads=args.threads, load_average=os.getloadavg()[0],
                  bandwidth_gb_s=cpu.bandwidth / 1e9, gflops=cpu.flops / 1e9,
                  model=setup["preset"], weights_bytes=shape.weights_bytes(), kv_bytes_per_token=kv_per_token,
                  rows=rows)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['cpu']} ({result['dtype']}, {args.threads} engine thread(s), load average {result['load_average']:.1f}): "
          f"copy bandwidth {result['bandwidth_gb_s']:.1f} GB/s, float32 matmul "
          f"{result['gflops']:.0f} GFLOP/s; model {setup['preset']} ({shape.weights_bytes() / 2**20:.1f} MiB of "
          f"weights, {kv_per_token:,} B KV per token)")
    print(f"{'batch':>5} {'context':>7} {'plan tok/s':>11} {'measured':>9} {'measured/plan':>13}  bound")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>7} {r['estimated_tokens_per_s']:>11,.0f} "
              f"{r['measured_tokens_per_s']:>9,.0f} {r['ratio']:>13.2f}  {r['bound']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
