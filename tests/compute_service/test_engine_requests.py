"""Sampling, stopping, streaming and bad input on the real engine (tiny model)."""

from __future__ import annotations

import asyncio
import json
import shutil
import time

import pytest

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.kv.pool import parse_block_size
from kvfleet.compute_service.model.config import ModelLoadError
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.conftest import random_prompt


@pytest.fixture(scope="module")
def engine(llama_dir):
    return LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=64 << 20, max_model_len=512))


def run_one(engine, prompt, sampling):
    return engine.generate([prompt], sampling)[0]


def test_seeded_sampling_is_reproducible(engine):
    prompt = random_prompt(40, seed=3)
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a, b = run_one(engine, prompt, params), run_one(engine, prompt, params)
    assert a.new_token_ids == b.new_token_ids
    other = run_one(engine, prompt, SamplingParams(**{**_fields(params), "seed": 99}))
    assert other.new_token_ids != a.new_token_ids


def test_top_k_one_is_greedy(engine):
    prompt = random_prompt(30, seed=4)
    greedy = run_one(engine, prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    top1 = run_one(engine, prompt, SamplingParams(max_tokens=12, temperature=0.7, top_k=1, seed=5, ignore_eos=True))
    assert top1.new_token_ids == greedy.new_token_ids


def test_max_tokens_and_length_finish(engine):
    out = run_one(engine, random_prompt(10, seed=5), SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(out.new_token_ids) == 7 and out.finish_reason == "length"
    assert out.completion_tokens == 7 and out.prompt_tokens == 10


def test_generation_stops_at_max_model_len(engine):
    out = run_one(engine, random_prompt(505, seed=6), SamplingParams(max_tokens=100, ignore_eos=True))
    assert out.finish_reason == "length" and out.prompt_tokens + out.completion_tokens == 512


def test_stop_string_cuts_text(engine):
    prompt = "hello there, "
    text = run_one(engine, prompt, SamplingParams(max_tokens=30, ignore_eos=True)).new_text
    # a two-character stop string taken from the middle of the free-running text
    k = next(i for i in range(3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stop = text[k:k + 2]
    out = run_one(engine, prompt, SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True))
    assert out.finish_reason == "stop"
    assert out.new_text == text[:text.index(stop)]
    assert len(out.new_token_ids) < 30


def test_eos_stops_unless_ignored(llama_dir):
    prompt = random_prompt(20, seed=8)
    eos_engine = LLMEngine(llama_dir, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))
    first = run_one(eos_engine, prompt, SamplingParams(max_tokens=1)).new_token_ids[0]
    # declare the model's first greedy token to be EOS: generation stops right there
    eos_engine.model_config.eos_token_ids = (first,)
    stopped = run_one(eos_engine, prompt, SamplingParams(max_tokens=5))
    assert stopped.finish_reason == "stop" and stopped.new_token_ids == [first]
    ignored = run_one(eos_engine, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    assert ignored.finish_reason == "length" and len(ignored.new_token_ids) == 5


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(seed=-1), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop="abc"), "stop"),
])
def test_invalid_sampling_is_a_clear_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_bad_prompts_are_refused_and_engine_keeps_serving(engine):
    engine.add_request("good", random_prompt(20, seed=9), SamplingParams(max_tokens=5, ignore_eos=True))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", random_prompt(600, seed=1), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [1, 2, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="unique"):
        engine.add_request("good", [1], SamplingParams())
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [o.request_id for o in outs] == ["good"] * 5 and outs[-1].finished


@pytest.mark.parametrize("value", [0, 8, 17, 100, 4096, -16, "big", None])
def test_invalid_block_size(value):
    with pytest.raises(ValueError, match="--block-size"):
        parse_block_size(value)


def test_block_size_presets():
    assert [parse_block_size(p) for p in ("chat", "code", "document")] == [256, 512, 1024]
    with pytest.raises(ValueError, match="--block-size"):
        EngineConfig(dtype="float32", block_size=24)


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "config.json").write_text(json.dumps({"model_type": "gpt2"})), "not supported"),
    (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors"),
    (lambda d: (d / "model.safetensors").write_bytes(b"garbage" * 10), "not a readable safetensors"),
    (lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer"),
    (lambda d: _drop_field(d, "hidden_size"), "hidden_size"),
])
def test_broken_model_directory_names_the_problem(llama_dir, tmp_path, damage, needle):
    broken = tmp_path / "model"
    shutil.copytree(llama_dir, broken)
    damage(broken)
    with pytest.raises(ModelLoadError, match=needle):
        LLMEngine(broken, EngineConfig(dtype="float32", block_size=16, kv_cache_memory=8 << 20))


def test_streaming_through_async_engine(engine):
    async def main():
        aengine = AsyncEngine(engine)
        try:
            chunks = [out async for out in aengine.generate(
                "s1", random_prompt(30, seed=11), SamplingParams(max_tokens=6, ignore_eos=True))]
            with pytest.raises(ValueError, match="empty"):
                async for _ in aengine.generate("s2", [], SamplingParams()):
                    pass
            return chunks
        finally:
            aengine.shutdown()

    chunks = asyncio.run(main())
    assert len(chunks) == 6 and all(len(c.new_token_ids) == 1 for c in chunks)
    assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def _drop_field(model_dir, field):
    cfg = json.loads((model_dir / "config.json").read_text())
    del cfg[field]
    (model_dir / "config.json").write_text(json.dumps(cfg))


def _first_step_batch(engine, arrive, batch_wait_s: float) -> int:
    """How many requests the first step of an idle ``AsyncEngine`` ran, with ``arrive(aengine)``
    submitting them."""
    sizes: list[int] = []
    real_step = engine.step

    def step():
        outputs = real_step()
        sizes.append(len(outputs))
        return outputs

    async def main(aengine):
        await arrive(aengine)

    engine.step = step
    aengine = AsyncEngine(engine, batch_wait_s=batch_wait_s)
    try:
        asyncio.run(main(aengine))
    finally:
        aengine.shutdown()
        del engine.step
    return sizes[0]


async def _drain(aengine, request_id, prompt):
    async for _ in aengine.generate(request_id, prompt, SamplingParams(max_tokens=3, ignore_eos=True)):
        pass


def test_a_burst_of_arrivals_is_one_first_batch(engine):
    """Four arrivals one after another, each once the step thread has taken the wake-up of the one
    before (so they are four arrivals, not one), all well within the batch wait: one first step."""
    async def trickling(aengine):
        drains = []
        for i in range(4):
            drains.append(asyncio.create_task(_drain(aengine, f"t{i}", random_prompt(10, seed=20 + i))))
            await asyncio.sleep(0)  # the task submits before its first real wait
            deadline = time.monotonic() + 30
            while aengine._wake.is_set():  # cleared by the step thread when it sees the arrival
                assert time.monotonic() < deadline, f"the step thread did not see arrival {i}"
                await asyncio.sleep(0.001)
        await asyncio.gather(*drains)

    assert _first_step_batch(engine, trickling, batch_wait_s=1.0) == 4


def test_batch_wait_must_not_be_negative(engine):
    with pytest.raises(ValueError, match="batch_wait_s"):
        AsyncEngine(engine, batch_wait_s=-1)
