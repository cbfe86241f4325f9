"""Where a P99 batch controller's throughput goes: the engine held at fixed caps, under the same
closed-loop load as ``bench/p99_controller.py``, for two step budgets.

    python bench/p99_sweep.py [--quick] [--json] [--caps 64,48,32,16] [--budgets 2048,128]

For each budget (``max_num_batched_tokens`` at the maximum cap, one engine each) and each cap, the
engine runs at that cap (``Scheduler.set_num_seqs_cap``: the step's budget follows it in proportion)
with ``--clients`` clients for ``--seconds``; figures over the second half. Printed per point: p99
and p50 inter-token latency, and generated tokens/s; as ratios to the same budget's maximum cap
(measured in the same process, minutes apart on a shared machine, so read the ratios, not the
milliseconds). A controller that must bring p99 down to a target can only pick a cap on this curve:
where the p99 falls little as the cap falls, it cuts deep, and the throughput goes with the cap.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import add_smoke_flag, engine_dtype, ensure_model  # noqa: E402
from bench.p99_controller import drive, p99  # noqa: E402


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers separated by commas, got {text!r}")
    return values


async def sweep(args) -> list[dict]:
    import torch

    from kvfleet.compute_service.engine.async_engine import AsyncEngine
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine

    torch.set_num_threads(1)
    model = ensure_model("tiny", ROOT / "models" / "bench-tiny") if args.smoke else ensure_model()  # smoke: models/bench-tiny
    points = []
    for budget in args.budgets:
        config = EngineConfig(block_size=16, kv_cache_memory=512 << 20, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=budget)
        engine = AsyncEngine(LLMEngine(model, config))
        for cap in args.caps:
            engine.engine.scheduler.set_num_seqs_cap(cap)
            run = await drive(engine, f"b{budget}-c{cap}", args.clients, args.seconds)
            itls, tokens = run.window(args.seconds / 2, args.seconds)
            points.append({"budget": budget, "cap": cap, "step_tokens": engine.engine.scheduler.step_token_budget,
                           "p99_ms": round(p99(itls) * 1e3, 1),
                           "p50_ms": round(sorted(itls)[len(itls) // 2] * 1e3, 1) if itls else float("nan"),
                           "tokens_per_s": round(tokens / (args.seconds / 2), 1)})
        engine.shutdown()
    for point in points:  # ratios to the same budget's largest cap
        top = max((p for p in points if p["budget"] == point["budget"]), key=lambda p: p["cap"])
        point["p99_frac"] = round(point["p99_ms"] / top["p99_ms"], 3)
        point["throughput_frac"] = round(point["tokens_per_s"] / max(top["tokens_per_s"], 1e-9), 3)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="15 s per point (default 30)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--caps", type=_ints, default=[64, 48, 32, 16])
    parser.add_argument("--budgets", type=_ints, default=[2048, 128],
                        help="step token budgets at the maximum cap (default 2048,128)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--clients", type=int, default=96)
    parser.add_argument("--seconds", type=float, default=None, help="per point (default 30, quick 15)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # one budget, two caps, 2 s each
        args.seconds, args.caps, args.budgets, args.clients, args.max_num_seqs = 2.0, [4, 2], [64], 4, 4
    args.seconds = args.seconds or (15.0 if args.quick else 30.0)
    if args.seconds < (2 if args.smoke else 4) or args.clients < 1 or max(args.caps) > args.max_num_seqs:
        parser.error("need --seconds >= 4, --clients >= 1, every cap <= --max-num-seqs")
    started = time.monotonic()
    points = asyncio.run(sweep(args))
    for p in points:
        print(f"budget {p['budget']:>5} cap {p['cap']:>3} ({p['step_tokens']:>4} tokens a step): p99 ITL "
              f"{p['p99_ms']:8.1f} ms ({p['p99_frac']:.2f}), p50 {p['p50_ms']:7.1f} ms, {p['tokens_per_s']:6.1f} "
              f"tokens/s ({p['throughput_frac']:.2f})")
    print(f"({time.monotonic() - started:.0f} s; ratios against the same budget's cap {max(args.caps)})")
    if args.json:
        print(json.dumps({"points": points, "clients": args.clients, "seconds": args.seconds, "dtype": engine_dtype()}))


if __name__ == "__main__":
    main()
