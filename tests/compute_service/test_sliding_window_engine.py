"""Sliding-window models in process: greedy tokens equal transformers' past the window (Mistral,
Qwen2 with every layer windowed, Qwen2 with a full first layer), whole prompts, chunked prefills and
prefix-cache hits; the models are sensitive (without the window transformers' tokens differ)."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.conftest import random_prompt
from tests.compute_service.windowed_models import WINDOWED, make_windowed_model, transformers_greedy

MAX_NEW = 60
PROMPTS = [random_prompt(n, seed=700 + n) for n in (5, 30, 70, 150)]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """``windowed(name)`` -> (model dir, transformers' greedy tokens per prompt), built once."""
    root = tmp_path_factory.mktemp("windowed")
    made = {}

    def get(name: str):
        if name not in made:
            model_dir = make_windowed_model(root / name, name)
            full_dir = make_windowed_model(root / f"{name}-full", name, windowed=False)
            want = [transformers_greedy(model_dir, p, MAX_NEW) for p in PROMPTS]
            # the window decides tokens: a kernel that ignored it could not pass
            assert want[3] != transformers_greedy(full_dir, PROMPTS[3], MAX_NEW), f"{name} does not feel its window"
            made[name] = (model_dir, want)
        return made[name]

    return get


def run(model_dir, prompts, **config) -> tuple[LLMEngine, list[list[int]]]:
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20, **config))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    engine.allocator.page_table.check()
    return engine, [o.new_token_ids for o in outs]


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_concurrent_prompts_match_transformers(windowed, name):
    model_dir, want = windowed(name)
    engine, got = run(model_dir, PROMPTS)
    assert got == want
    assert engine.stats().blocks.num_used == 0


@pytest.mark.parametrize("name", ["mistral", "qwen2_mixed"])
def test_chunked_prefill_matches_transformers(windowed, name):
    """Chunks of 32 tokens: each chunk's queries see the window reaching back into earlier chunks."""
    model_dir, want = windowed(name)
    _, got = run(model_dir, PROMPTS, max_num_batched_tokens=32)
    assert got == want


def test_prefix_cache_hits_match_transformers(windowed):
    model_dir, want = windowed("qwen2")
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))
    first = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=MAX_NEW))[0]
    again = engine.generate([PROMPTS[3]], SamplingParams(max_tokens=MAX_NEW))[0]
    assert again.cached_tokens > 0
    assert first.new_token_ids == again.new_token_ids == want[3]


def used_blocks_while_generating(model_dir, prompt: list[int], max_tokens: int) -> tuple[list[int], list[int]]:
    """Greedy tokens and the pool's used blocks after every step (the allocator's public stats)."""
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))
    engine.add_request("long", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    tokens, used = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        used.append(engine.stats().blocks.num_used)
        engine.allocator.page_table.check()
    assert engine.stats().blocks.num_used == 0
    return tokens, used


def test_a_long_generation_holds_only_its_window(windowed):
    """Mistral, window 24 in blocks of 16: 330 tokens would fill 21 blocks; the sequence holds the
    blocks its window reaches (2-3) and the one it writes into, whatever its length. The blocks it
    gave back were committed: they are cached, not freed."""
    model_dir, _ = windowed("mistral")
    prompt = random_prompt(30, seed=1)
    tokens, used = used_blocks_while_generating(model_dir, prompt, 300)
    assert tokens == transformers_greedy(model_dir, prompt, 300, ignore_eos=True)
    assert max(used) <= 4, used


def test_a_model_with_a_full_attention_layer_gives_nothing_back(windowed):
    """Qwen2 with max_window_layers 1: layer 0 attends in full, so every block stays."""
    model_dir, _ = windowed("qwen2_mixed")
    _, used = used_blocks_while_generating(model_dir, random_prompt(30, seed=2), 120)
    assert max(used) == -(-150 // 16)
