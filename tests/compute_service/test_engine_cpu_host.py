"""The engine on a CPU host: it sizes torch's intra-op threads (kvfleet/compute_service/engine/thread_governor.py)
and resolves ``dtype="auto"`` to what this CPU runs natively."""

from __future__ import annotations

import time

import torch

from kvfleet.compute_service.engine.cpu_host import host_cpu_flags, resolve_dtype, usable_cpus
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.engine.thread_governor import thread_candidates
from kvfleet.core.sampling import SamplingParams


def test_engine_sets_the_threads_it_is_asked_for(llama_dir, monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("KVFLEET_CPU_THREADS", "1")
        LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("KVFLEET_CPU_THREADS", "2")
        LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_engine_starts_at_all_cpus_and_probes_its_thread_count_on_the_first_step(llama_dir, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("KVFLEET_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    candidates = thread_candidates(usable_cpus(), {})
    try:
        engine = LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))
        assert candidates[0] == max(1, usable_cpus() - 1)  # the count it leaves all CPUs for, if they measure slower
        assert torch.get_num_threads() == candidates[-1] == usable_cpus()
        governor = engine.thread_probe.governor
        deadline = time.monotonic() + 30
        while True:  # the first probe comes with the first step
            out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
            assert len(out.new_token_ids) == 3
            if len(candidates) < 2 or governor.chosen or time.monotonic() > deadline:
                break
        if len(candidates) == 2:  # a host with more than one CPU: it probed both counts
            assert sum(governor.chosen.values()) >= 1 and governor.current in candidates
        assert engine.stats().intra_op_threads == torch.get_num_threads() == governor.current
    finally:
        torch.set_num_threads(before)


def test_auto_dtype_resolves_on_construction_and_runs(llama_dir):
    config = EngineConfig(block_size=16, kv_cache_memory=8 << 20, dtype="auto")
    assert config.dtype == resolve_dtype("auto", "cpu", host_cpu_flags()) != "auto"
    engine = LLMEngine(llama_dir, config)
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.new_token_ids) == 3
    assert engine.runner.kv_cache.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]


def test_the_default_dtype_is_the_fast_one_on_this_cpu():
    assert EngineConfig().dtype == resolve_dtype("auto", "cpu", host_cpu_flags())
    assert EngineConfig(dtype="float32").dtype == "float32"  # still there, token-exact against transformers
