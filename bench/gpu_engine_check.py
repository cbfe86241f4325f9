"""The engine on a CUDA device: greedy tokens against transformers on the same device, and decode speed.

For each dtype (float32, bfloat16): a random llama (``kvfleet make-model --preset small``, 8 layers)
and 16 seeded prompts of 16-2,000 tokens; the engine (paged attention through the Triton kernels)
and ``transformers.generate`` on the same device and dtype, greedy, 32 new tokens each; then decode
tokens/s at batch 1, 16 and 64 with 1,024-token prompts. float32 must agree token for token; in
bfloat16 both sides round differently, so the agreement before the first difference is reported.

    python bench/gpu_engine_check.py [--device cuda] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPT_LENGTHS = [16, 17, 64, 100, 255, 256, 257, 511, 700, 1023, 1025, 1500, 2000, 33, 1, 128]
NEW_TOKENS = 32


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def _transformers_greedy(model_dir: Path, prompts: list[list[int]], dtype, device: str) -> list[list[int]]:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=258)
            outs.append(out[0, len(p):].tolist())
    return outs


def _engine(model_dir: Path, dtype: str, device: str, kv_bytes: int):
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(model_dir, EngineConfig(block_size=64, kv_cache_memory=kv_bytes, max_num_seqs=64,
                                             max_num_batched_tokens=4096, dtype=dtype, device=device))


def check_dtype(model_dir: Path, dtype_name: str, device: str, quick: bool) -> dict:
    import torch

    from kvfleet.core.sampling import SamplingParams

    prompts = [_prompt(n, seed=n) for n in (PROMPT_LENGTHS[:4] if quick else PROMPT_LENGTHS)]
    engine = _engine(model_dir, dtype_name, device, (256 << 20) if quick else (4 << 30))
    ours = [o.new_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]
    theirs = _transformers_greedy(model_dir, prompts, getattr(torch, dtype_name), device)
    identical = sum(a == b for a, b in zip(ours, theirs))
    before_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) / len(a) for a, b in zip(ours, theirs)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    speed = {}
    for batch in (1, 4) if quick else (1, 16, 64):
        batch_prompts = [_prompt(1024, seed=1000 + i) for i in range(batch)]
        engine.generate(batch_prompts[:1], SamplingParams(max_tokens=2))
        sync()
        started = time.perf_counter()
        outs = engine.generate(batch_prompts, SamplingParams(max_tokens=16 if quick else 128, ignore_eos=True))
        sync()
        speed[f"batch_{batch}_tokens_per_s"] = round(sum(len(o.new_token_ids) for o in outs) / (time.perf_counter() - started), 1)
    return dict(dtype=dtype_name, requests=len(prompts), identical=identical,
                agreement_before_first_difference=round(sum(before_diff) / len(before_diff), 4), **speed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--quick", action="store_true", help="4 prompts, batches 1 and 4 (a check of the script itself)")
    args = parser.parse_args()
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_engine_check: no CUDA device here", file=sys.stderr)
        return 2
    from kvfleet.cli.model_maker import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(Path(tmp) / "small", "small", seed=0)
        rows = [check_dtype(model_dir, d, args.device, args.quick) for d in ("float32", "bfloat16")]
    result = dict(device=torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
                  float32_token_exact=rows[0]["identical"] == rows[0]["requests"], rows=rows)
    if not args.json:
        for r in rows:
            print(f"{r['dtype']}: {r['identical']}/{r['requests']} requests token-identical to transformers "
                  f"({r['agreement_before_first_difference']:.1%} of tokens before a first difference); decode "
                  f"tokens/s by batch: {[(k, v) for k, v in r.items() if k.endswith('tokens_per_s')]}")
    print(json.dumps(result))
    return 0 if result["float32_token_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
