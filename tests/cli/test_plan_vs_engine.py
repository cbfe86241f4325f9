"""The plan agrees with the engine: the concurrency ``kvfleet plan`` predicts for a model, a KV
budget and a context is exactly how many such sequences the engine admits into a pool sized from
the same budget (one more waits)."""

from __future__ import annotations

import json
import math

import pytest
from safetensors import safe_open

from kvfleet.cli import cli
from kvfleet.cli.model_maker import make_model
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core.sampling import SamplingParams

KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 32 * 4  # tiny: 4 layers, 2 KV heads of 32, float32


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("plan") / "tiny", "tiny", seed=3)


def plan(capsys, *args: str) -> dict:
    assert cli.main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def admitted(model_dir, budget: int, block_size: int, context: int, num_seqs: int,
             kv_cache_dtype: str = "auto") -> tuple[int, int]:
    """(running, waiting) after one step of ``num_seqs`` distinct prompts of ``context`` tokens."""
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=block_size, kv_cache_memory=budget, max_num_seqs=1024,
                                               max_num_batched_tokens=num_seqs * context,
                                               kv_cache_dtype=kv_cache_dtype))
    for i in range(num_seqs):
        prompt = [(i * 7 + j) % 256 for j in range(context)]  # distinct first blocks: no prefix sharing
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    return stats.num_running, stats.num_waiting


@pytest.mark.parametrize("block_size, context, budget", [
    (16, 100, 30 * 16 * KV_BYTES_PER_TOKEN + 1000),   # 7 blocks a sequence, 30 in the pool: 4 fit
    (32, 64, 9 * 32 * KV_BYTES_PER_TOKEN),            # whole blocks: 2 a sequence, 9 in the pool: 4 fit
    (64, 250, 25 * 64 * KV_BYTES_PER_TOKEN - 1),      # 4 a sequence, 24 whole blocks in the pool: 6 fit
])
def test_predicted_concurrency_is_what_the_engine_admits(capsys, tiny_dir, block_size, context, budget):
    predicted = plan(capsys, "--model", str(tiny_dir), "--device", "cpu", "--memory-bandwidth", "10",
                     "--context", str(context), "--block-size", str(block_size), "--kv-cache-memory", str(budget))
    assert predicted["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN
    n = predicted["max_concurrent_seqs"]
    assert n >= 2
    assert admitted(tiny_dir, budget, block_size, context, n + 1) == (n, 1)


def test_fp8_plan_counts_the_scales_the_engine_stores(capsys, tiny_dir):
    """FP8 rows carry a float32 scale each (per token and KV head): a plan that counted one byte per
    element alone promised more sequences than the pool holds."""
    per_token = 2 * 4 * 2 * (32 * 1 + 4)  # tiny: 4 layers, 2 KV heads of 32 FP8 bytes + a 4-byte scale
    budget = 30 * 16 * per_token
    predicted = plan(capsys, "--model", str(tiny_dir), "--device", "cpu", "--memory-bandwidth", "10",
                     "--context", "100", "--block-size", "16", "--kv-cache-memory", str(budget),
                     "--kv-cache-dtype", "fp8_e4m3")
    assert predicted["kv_bytes_per_token"] == per_token
    n = predicted["max_concurrent_seqs"]
    assert admitted(tiny_dir, budget, 16, 100, n + 1, "fp8_e4m3") == (n, 1)


def test_predicted_weights_are_the_checkpoints_parameters(capsys, tiny_dir):
    with safe_open(str(tiny_dir / "model.safetensors"), "pt") as f:
        stored = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    predicted = plan(capsys, "--model", str(tiny_dir), "--device", "cpu", "--memory-bandwidth", "10", "--context", "64")
    assert predicted["num_params"] == stored
    assert predicted["weights_bytes"] == 4 * stored  # float32

