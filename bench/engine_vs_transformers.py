"""Engine throughput against ``transformers.generate`` on the same model, prompts and machine.

Each side runs in its own process (peak resident memory is its own): the same seeded prompts,
greedy, a fixed number of new tokens for every request. ``transformers`` gets one left-padded batch
with its default dynamic cache; the engine gets all requests at once and batches them continuously.

    python bench/engine_vs_transformers.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import ROOT, add_smoke_flag, ensure_model, peak_rss_mib, run_child, seeded_prompts  # noqa: E402

FULL = dict(requests=32, min_len=32, max_len=1024, new_tokens=128)
QUICK = dict(requests=32, min_len=32, max_len=256, new_tokens=32)
SMOKE = dict(requests=1, min_len=8, max_len=16, new_tokens=2)  # on models/bench-tiny


def run_engine(model: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict:
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.sampling import SamplingParams

    engine = LLMEngine(model, EngineConfig(block_size=64, kv_cache_memory=1 << 30, max_num_seqs=64,
                                           max_num_batched_tokens=2048, dtype=dtype))
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up: kernels built, caches hot
    started = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.new_token_ids) for o in outs)
    return dict(seconds=elapsed, tokens=tokens, tokens_per_s=tokens / elapsed, peak_rss_mib=peak_rss_mib(),
                preemptions=engine.stats().num_preemptions)


def run_transformers(model: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
    pad = 258
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        hf.generate(ids[:1, -16:], attention_mask=mask[:1, -16:], max_new_tokens=2, do_sample=False,
                    pad_token_id=pad)  # warm-up
        started = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - started
    tokens = (out.shape[1] - width) * out.shape[0]
    return dict(seconds=elapsed, tokens=tokens, tokens_per_s=tokens / elapsed, peak_rss_mib=peak_rss_mib())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter prompts and outputs (< 1 minute)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="weights and KV dtype, the same for both sides (default float32)")
    parser.add_argument("--side", choices=["engine", "transformers"], help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    model = ensure_model("tiny", ROOT / "models" / "bench-tiny") if args.smoke else ensure_model()
    prompts = seeded_prompts(shape["requests"], shape["min_len"], shape["max_len"])
    if args.side:
        run = run_engine if args.side == "engine" else run_transformers
        print(json.dumps(run(model, prompts, shape["new_tokens"], args.dtype)))
        return 0
    flags = (["--smoke"] if args.smoke else ["--quick"] if args.quick else []) + ["--dtype", args.dtype]
    hf = run_child(Path(__file__), flags + ["--side", "transformers"])
    ours = run_child(Path(__file__), flags + ["--side", "engine"])
    result = dict(
        shape=shape, model=str(model.relative_to(model.parent.parent)), dtype=args.dtype,
        engine_tokens_per_s=round(ours["tokens_per_s"], 1), transformers_tokens_per_s=round(hf["tokens_per_s"], 1),
        ratio=round(ours["tokens_per_s"] / hf["tokens_per_s"], 2),
        engine_peak_rss_mib=round(ours["peak_rss_mib"]), transformers_peak_rss_mib=round(hf["peak_rss_mib"]),
        engine_preemptions=ours["preemptions"],
    )
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{shape['requests']} requests, prompts {shape['min_len']}-{shape['max_len']} tokens, "
              f"{shape['new_tokens']} new tokens each, greedy, model {result['model']}, {args.dtype}")
        print(f"{'':14}{'tokens/s':>10}{'peak RSS MiB':>14}")
        print(f"{'transformers':14}{result['transformers_tokens_per_s']:>10}{result['transformers_peak_rss_mib']:>14}")
        print(f"{'kvfleet':14}{result['engine_tokens_per_s']:>10}{result['engine_peak_rss_mib']:>14}")
        print(f"ratio (kvfleet / transformers): {result['ratio']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
