"""Every benchmark runs end to end in its ``--smoke`` shape under both defaults of dtype ``auto``
(``KVFLEET_DEFAULT_DTYPE=float32`` and ``=bfloat16``), so that none of them breaks on a CPU its author
did not have (bench/kv_layout.py once sized its pool in float32 bytes and crashed where ``auto`` is
bfloat16). Each must exit 0 and print one JSON object on its last line; one that resolves the engine's
default names it there (``dtype``), one that pins a dtype names that. The figures of a smoke run mean
nothing and are not read.

Benchmarks that construct no engine (block_service alone, kernels, emulations that pin float32) run
once, under the bfloat16 default; so do those that pass their pinned dtype to every engine and node
they start (``PINNED``), under the default that is not their pin: the default cannot reach them, and
their JSON must name the pin all the same. vLLM's side needs ``.venv-peers`` (``make bench-peers``): without it
engine_vs_vllm's smoke runs kvfleet's side and says in its JSON that vLLM was skipped, memory_breakdown
says so too, and fp8_accuracy reports vLLM's figures null with the reason; all are checked. vLLM's side
runs in its own interpreter and pins its dtype, so the default cannot reach it: where ``.venv-peers``
exists it runs under the bfloat16 default only, and the float32 run takes the path without it (the one a
machine without vLLM takes), so both paths run here.

``make test`` runs these in an xdist invocation of their own (``-n 2``): every run has its own
temporary directories and ports; a benchmark model two runs make at once lands whole (one copy is
renamed into place, the other dropped: ``bench.common.ensure_model``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfleet.compute_service.engine.cpu_host import DEFAULT_DTYPE_ENV

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
# imported, not run
HELPERS = {"__init__", "chat_prompts", "common", "disagg_client", "disagg_sweep", "prose_corpus", "tree_memory"}
NOT_HERE = {"partitions": "issue 34's partition bed, smoke-tested with tests/partition"}
BENCHMARKS = sorted(p.stem for p in BENCH.glob("*.py")
                    if p.stem not in HELPERS | NOT_HERE.keys() and not p.stem.startswith("gpu_"))
NO_ENGINE = {"block_manager", "eviction_cost", "fleet_scale", "paged_attention", "fp8_kv_variants"}
NEEDS_SMOLLM2 = {"disagg", "fp8_accuracy", "fp8_kv_variants", "kv_transfer", "kv_wire"}
# JSON "dtype": the default the run was given (resolved by the engine, or by bench.common.engine_dtype)
REPORTS_DEFAULT = {"block_service_failover", "canary", "cluster_ab", "cluster_overhead", "cold_start", "kv_layout",
                   "kv_tiers", "long_context", "p99_controller", "p99_sweep", "plan_vs_measured"}
# their vLLM side (KVFLEET_PEERS_PYTHON, else .venv-peers): run under the bfloat16 default only
VLLM_SIDE = {"engine_vs_vllm", "fp8_accuracy", "memory_breakdown"}
NO_PEERS = "/nonexistent/kvfleet-smoke-float32-runs-without-vllm"
PINNED = {"disagg": "float32", "engine_vs_transformers": "float32", "engine_vs_vllm": "bfloat16",
          "kv_transfer": "float32", "memory_breakdown": "float32", "paged_attention": "float32", "routing": "float32",
          "tenant_fairness": "float32"}


def runs_under(name: str, dtype: str) -> bool:
    """Whether the smoke runs ``name`` under the ``dtype`` default. A benchmark that constructs no
    engine, or pins its dtype on every engine and node it starts (PINNED, but for a vLLM side that
    takes another path per default), runs once: under the default that is not its pin, which its JSON
    must then still name."""
    if name in NO_ENGINE:
        return dtype == "bfloat16"
    if name in PINNED and name not in VLLM_SIDE:
        return dtype != PINNED[name]
    return True


# the runs that may start vLLM (minutes each) first, so that under xdist the other worker takes the rest
CASES = sorted((pytest.param(name, dtype, id=f"{name}-{dtype}")
                for name in BENCHMARKS for dtype in ("float32", "bfloat16") if runs_under(name, dtype)),
               key=lambda case: not (case.values[0] in VLLM_SIDE and case.values[1] == "bfloat16"))


def test_every_benchmark_has_a_smoke_shape():
    missing = [name for name in BENCHMARKS if "add_smoke_flag(parser)" not in (BENCH / f"{name}.py").read_text()]
    assert not missing, f"benchmarks without --smoke (bench.common.add_smoke_flag): {missing}"
    assert {"kv_layout", "routing", "fp8_accuracy"} <= set(BENCHMARKS)  # the glob found them


@pytest.mark.process  # interpreters, and the cluster benchmarks' clusters
@pytest.mark.bench_smoke  # `make test` runs these in an invocation of their own (-n 2); `make test-bench` only these
@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_benchmark_smoke(name, dtype):
    if name in NEEDS_SMOLLM2 and not (SMOLLM2 / "config.json").is_file():
        pytest.skip(f"{name} needs {SMOLLM2.relative_to(ROOT)} (`kvfleet models pull`)")
    env = {**os.environ, DEFAULT_DTYPE_ENV: dtype}
    if name in VLLM_SIDE and dtype == "float32":
        env["KVFLEET_PEERS_PYTHON"] = NO_PEERS
    proc = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{name} --smoke exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{name} --smoke printed nothing"
    result = json.loads(lines[-1])
    assert isinstance(result, dict)
    if name in REPORTS_DEFAULT:
        assert result["dtype"] == dtype
    elif name in PINNED:
        assert result["dtype"] == PINNED[name]
    if name == "engine_vs_vllm" and result.get("ratio") is None:  # no vLLM: said, never a silent pass
        assert "make bench-peers" in result["vllm_skipped"]
    if name == "memory_breakdown":
        assert "vllm" in result or "make bench-peers" in result["vllm_skipped"]
    if env.get("KVFLEET_PEERS_PYTHON") == NO_PEERS:  # the path without vLLM was taken, and said
        assert result.get("ratio") is None and (result.get("vllm_skipped") or result.get("vllm_reason"))
    if name == "fp8_accuracy":
        assert result["ppl_16bit"] > 1 and result["ppl_fp8"] > 1 and result["kl_mean"] >= 0
        assert (result["vllm_ppl_increase_frac"] is None) == bool(result["vllm_reason"])
