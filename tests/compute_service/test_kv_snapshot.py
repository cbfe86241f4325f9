"""KV snapshots through a real engine: written from one engine's pool, restored into another's,
refused when they are not this node's to restore (the node then starts cold)."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.kv.snapshot_io import snapshot_path
from kvfleet.compute_service.node.settings import WarmStartSettings
from kvfleet.compute_service.node.warm_start import WarmStart
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.conftest import random_prompt

BS = 16
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PREFIX = random_prompt(5 * BS + 3, seed=40)
PROMPTS = [PREFIX + random_prompt(7 + i, seed=41 + i) for i in range(3)]


def make_engine(model_dir, block_size: int = BS) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=block_size, kv_cache_memory=4 << 20, node_id="n0"))


def args_for(model_dir, snapshot_dir) -> tuple[WarmStartSettings, str, str]:
    """(settings, node id, model directory) of a WarmStart."""
    return WarmStartSettings(kv_snapshot_dir=str(snapshot_dir), kv_snapshot_blocks=64, kv_snapshot_interval_s=0.0), \
        "n0", str(model_dir)


def on_engine(engine: LLMEngine, args, action):
    """``action(warm_start)`` over ``engine`` (on its own thread, as a node runs it); "save" and
    "restore" name WarmStart's."""
    if isinstance(action, str):
        action = {"save": lambda warm: warm.save("test"), "restore": WarmStart.restore}[action]

    async def run():
        async_engine = AsyncEngine(engine)
        try:
            return await action(WarmStart(*args, async_engine))
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    return asyncio.run(run())


def served(engine: LLMEngine) -> list[tuple[list[int], int]]:
    """Each prompt alone, in order: (greedy tokens, cached prompt tokens)."""
    outs = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
    return [(o.new_token_ids, o.cached_tokens) for o in outs]


@pytest.fixture(scope="module")
def original(model_dirs, tmp_path_factory):
    """An engine that served the prompts, and the snapshot it wrote."""
    engine = make_engine(model_dirs["llama"])
    outputs = served(engine)
    assert [cached for _, cached in outputs[1:]] == [5 * BS, 5 * BS]  # the prefix is reused
    directory = tmp_path_factory.mktemp("snap")
    assert on_engine(engine, args_for(model_dirs["llama"], directory), "save")
    return engine, outputs, directory


def pool_rows(engine: LLMEngine) -> dict[bytes, torch.Tensor]:
    """Block hash → that block's K/V rows in the pool ([layers, 2, kv_heads, block_size, head_dim])."""
    return {b.block_hash: engine.runner.kv_cache[:, :, b.block_id].clone() for b in engine.kv.usage.blocks()}


def test_restored_blocks_hold_the_same_bytes_and_serve_the_same_tokens(original, model_dirs, tmp_path):
    engine, outputs, directory = original
    fresh = make_engine(model_dirs["llama"])
    restored = on_engine(fresh, args_for(model_dirs["llama"], directory), "restore")
    before, after = pool_rows(engine), pool_rows(fresh)
    assert restored == len(after) > 5  # the shared prefix's blocks and more
    for block_hash, rows in after.items():
        assert torch.equal(rows, before[block_hash])
    stats = fresh.stats().blocks
    assert (stats.num_cached, stats.num_used) == (restored, 0)  # cached: committed and unreferenced
    again = served(fresh)
    assert [tokens for tokens, _ in again] == [tokens for tokens, _ in outputs]
    assert again[0][1] == 5 * BS  # the first request after the start hits the restored prefix


def test_a_snapshot_of_another_block_size_is_refused_and_the_node_starts_cold(original, model_dirs, caplog):
    _, _, directory = original
    other = make_engine(model_dirs["llama"], block_size=2 * BS)
    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.warm_start"):
        assert on_engine(other, args_for(model_dirs["llama"], directory), "restore") == 0
    assert ("KV snapshot" in caplog.text and "refused: it was taken with another configuration: "
            f"block_size {2 * BS} here, {BS} in the snapshot; starting cold" in caplog.text)
    assert len(caplog.records) == 1
    assert other.stats().blocks.num_cached == 0 and len(other.kv.usage) == 0


def test_a_snapshot_of_another_model_is_refused(original, model_dirs, caplog):
    _, _, directory = original
    other = make_engine(model_dirs["mistral"])  # same shapes as the llama variant, other weights
    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.warm_start"):
        assert on_engine(other, args_for(model_dirs["mistral"], directory), "restore") == 0
    assert "refused: it was taken with another configuration: model " in caplog.text
    assert other.stats().blocks.num_cached == 0


@pytest.mark.parametrize("damage, why", [
    (lambda data: data[:-1000], "cannot be read"),                                        # truncated
    (lambda data: data[:-100] + bytes([data[-100] ^ 0x01]) + data[-99:], "checksum does not match"),  # a flipped bit
    (lambda data: b"\x00" * len(data), "cannot be read"),
])
def test_a_damaged_snapshot_is_refused(original, model_dirs, tmp_path, caplog, damage, why):
    _, _, directory = original
    (source,) = directory.glob("*.safetensors")
    target = tmp_path / source.name
    target.write_bytes(damage(source.read_bytes()))
    fresh = make_engine(model_dirs["llama"])
    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.warm_start"):
        assert on_engine(fresh, args_for(model_dirs["llama"], tmp_path), "restore") == 0
    assert why in caplog.text and "starting cold" in caplog.text
    assert "Traceback" not in caplog.text and len(caplog.text.strip().splitlines()) == 1
    assert fresh.stats().blocks.num_cached == 0


def test_an_unchanged_pool_is_not_written_again(original, model_dirs, tmp_path):
    engine, _, _ = original

    async def twice(warm):
        return await warm.save("first"), await warm.save("second")

    assert on_engine(engine, args_for(model_dirs["llama"], tmp_path), twice) == (True, False)


def test_snapshots_are_written_every_interval_while_serving(original, model_dirs, tmp_path):
    engine, _, _ = original
    args = args_for(model_dirs["llama"], tmp_path)
    args[0].kv_snapshot_interval_s = 0.05
    path = snapshot_path(tmp_path, "n0")

    async def serve_a_while(warm):
        warm.start_periodic()
        for _ in range(1200):  # until the first periodic snapshot lands (no drain has happened)
            if path.exists():
                break
            await asyncio.sleep(0.05)
        written = path.exists()
        await warm.on_drain()  # the pool did not change since: nothing more is written
        return written

    assert on_engine(engine, args, serve_a_while)
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("warmup, prefilled", [("random", 4 * 40), ("minimal", 0)])
def test_random_warmup_prefills_random_prompts(model_dirs, tmp_path, warmup, prefilled):
    engine = make_engine(model_dirs["llama"])
    args = args_for(model_dirs["llama"], tmp_path)
    args[0].warmup, args[0].warmup_tokens = warmup, 40

    async def warm_up(warm):
        return await warm.random_prefill(engine.model_config.vocab_size, engine.max_model_len)

    on_engine(engine, args, warm_up)
    assert engine.stats().prompt_tokens_computed == prefilled
