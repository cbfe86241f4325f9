"""The engine times each request's queue and prefill (kvfleet/compute_service/engine/request_phases.py)."""

from __future__ import annotations

import time

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core.sampling import SamplingParams


def test_each_request_is_timed_once_from_its_arrival_at_the_node(llama_dir):
    engine = LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20,
                                               max_num_batched_tokens=32))
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("waited", list(range(1, 11)), sampling, arrival_s=time.monotonic() - 5.0)  # 5 s on the way
    engine.add_request("chunked", list(range(1, 101)), sampling)  # 100 tokens: chunks of the 32-token budget
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    stats = engine.stats()
    assert stats.queue_time.count == stats.prefill_time.count == 2, "one observation per request, not per token"
    assert 5.0 <= stats.queue_time.sum < 5.0 + 60
    assert stats.prefill_time.sum > 0 and steps >= 4
