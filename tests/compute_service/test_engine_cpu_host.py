"""The engine on a CPU host: it sizes torch's intra-op threads (compute_service/cpu_host.py) and
resolves ``dtype="auto"`` to what this CPU runs natively."""

from __future__ import annotations

import torch

from compute_service.cpu_host import host_cpu_flags, intra_op_threads, resolve_dtype, usable_cpus
from compute_service.engine import EngineConfig, LLMEngine
from kvfleet.sampling import SamplingParams


def test_engine_sets_the_threads_it_is_asked_for(llama_dir, monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("KVFLEET_CPU_THREADS", "1")
        LLMEngine(llama_dir, EngineConfig(block_size=16, kv_cache_memory=8 << 20))
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("KVFLEET_CPU_THREADS", "2")
        LLMEngine(llama_dir, EngineConfig(block_size=16, kv_cache_memory=8 << 20))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_engine_leaves_a_cpu_free_by_default(llama_dir, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("KVFLEET_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        LLMEngine(llama_dir, EngineConfig(block_size=16, kv_cache_memory=8 << 20))
        assert torch.get_num_threads() == intra_op_threads(usable_cpus(), {}) == max(1, usable_cpus() - 1)
    finally:
        torch.set_num_threads(before)


def test_auto_dtype_resolves_on_construction_and_runs(llama_dir):
    config = EngineConfig(block_size=16, kv_cache_memory=8 << 20, dtype="auto")
    assert config.dtype == resolve_dtype("auto", "cpu", host_cpu_flags()) != "auto"
    engine = LLMEngine(llama_dir, config)
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.new_token_ids) == 3
    assert engine.runner.kv_cache.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
