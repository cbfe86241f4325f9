"""Lower KV tiers in a real engine (tiny llama, float32, in-process page table): a block evicted from
the pool is demoted, a prefix hit on it is promoted instead of recomputed, host cascades to disk,
a corrupted disk block is recomputed, a preempted sequence is swapped out and back. Every greedy
token must equal a run without tiers: a block whose bytes changed on the way shows there."""

from __future__ import annotations

import pytest
import torch

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.kv.disk_pool import PREFIX
from kvfleet.compute_service.kv.pool import bytes_per_block
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.conftest import random_prompt

BS = 16
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPT = random_prompt(64, seed=11)            # 3 reusable blocks (the 64th token is computed)
OTHERS = [random_prompt(100, seed=20 + i) for i in range(3)]


def per_block(model_dir) -> int:
    return bytes_per_block(ModelConfig.from_dir(model_dir), BS, torch.float32)


def engine(model_dir, pool_blocks: int, **tiers) -> LLMEngine:
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BS, kv_cache_memory=pool_blocks * per_block(model_dir),
                                             **tiers))


def pool_bytes(eng: LLMEngine) -> dict[bytes, torch.Tensor]:
    """K and V (all layers) of PROMPT's reusable blocks in the pool now, by block hash (its last
    block is recomputed in a chunk of another length: its floats may differ in the last bit)."""
    reusable = {tuple(PROMPT[i * BS:(i + 1) * BS]) for i in range(3)}
    return {b.block_hash: eng.runner.kv_cache[:, :, b.block_id].clone() for b in eng.kv.usage.blocks()
            if b.token_ids in reusable}


def revisit(eng: LLMEngine) -> tuple[list[int], int]:
    """PROMPT, then prompts that evict its blocks from an 8-block pool, then PROMPT again: its
    tokens the second time, and the prompt tokens computed for it. PROMPT's committed blocks must
    hold the same bytes the second time (promoted or recomputed)."""
    first = eng.generate([PROMPT], GREEDY)[0].new_token_ids
    written = pool_bytes(eng)
    for other in OTHERS:
        eng.generate([other], GREEDY)
    before = eng.stats().prompt_tokens_computed
    again = eng.generate([PROMPT], GREEDY)[0].new_token_ids
    assert again == first
    now = pool_bytes(eng)
    assert len(written.keys() & now.keys()) == 3
    for block_hash in written.keys() & now.keys():
        assert torch.equal(now[block_hash], written[block_hash]), "a block's bytes changed on the way"
    eng.allocator.page_table.check()
    return again, eng.stats().prompt_tokens_computed - before


def test_an_evicted_block_hit_again_is_promoted_from_host_not_recomputed(llama_dir):
    plain_tokens, plain_computed = revisit(engine(llama_dir, 8))
    assert plain_computed == len(PROMPT)  # without tiers the blocks were evicted: all recomputed

    tiered = engine(llama_dir, 8, kv_host_memory=32 * per_block(llama_dir))
    tokens, computed = revisit(tiered)
    assert tokens == plain_tokens
    assert computed == len(PROMPT) - 3 * BS
    stats = tiered.stats()
    assert stats.lookups.host >= 3 and stats.lookups.disk == 0
    assert stats.tiers.host_used > 0


def test_host_cascades_to_disk_and_a_disk_hit_is_promoted(llama_dir, tmp_path):
    plain_tokens, _ = revisit(engine(llama_dir, 8))
    tiered = engine(llama_dir, 8, kv_host_memory=2 * per_block(llama_dir), kv_disk_dir=str(tmp_path / "kv"),
                    kv_disk_bytes=64 * per_block(llama_dir))
    tokens, computed = revisit(tiered)
    assert tokens == plain_tokens
    assert computed == len(PROMPT) - 3 * BS
    stats = tiered.stats()
    assert stats.lookups.disk >= 1 and stats.tiers.disk_used > 0
    assert any((tmp_path / "kv").glob(f"{PREFIX}*"))


def test_a_corrupted_disk_block_is_recomputed_never_served(llama_dir, tmp_path):
    plain_tokens, _ = revisit(engine(llama_dir, 8))
    disk = tmp_path / "kv"
    tiered = engine(llama_dir, 8, kv_host_memory=1 * per_block(llama_dir), kv_disk_dir=str(disk),
                    kv_disk_bytes=64 * per_block(llama_dir))
    first = tiered.generate([PROMPT], GREEDY)[0].new_token_ids
    for other in OTHERS:
        tiered.generate([other], GREEDY)
    for path in disk.glob(f"{PREFIX}*"):  # flip bytes in every block file
        data = bytearray(path.read_bytes())
        data[100:116] = bytes(b ^ 0xFF for b in data[100:116])
        path.write_bytes(bytes(data))
    disk_hits = tiered.stats().lookups.disk
    before = tiered.stats().prompt_tokens_computed
    again = tiered.generate([PROMPT], GREEDY)[0].new_token_ids
    assert first == again == plain_tokens
    assert tiered.stats().lookups.disk == disk_hits          # nothing served from the corrupted files
    assert tiered.stats().prompt_tokens_computed - before > len(PROMPT) - 3 * BS


def test_swap_preemption_round_trip_is_token_exact_and_skips_recompute(llama_dir):
    prompts = [random_prompt(90 + 7 * i, seed=200 + i) for i in range(8)]
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    # 8 sequences growing to ~9 blocks each do not fit in 24 blocks at once
    recompute = engine(llama_dir, 24)
    want = [o.new_token_ids for o in recompute.generate(prompts, sampling)]
    assert recompute.stats().num_preemptions > 0

    swapping = engine(llama_dir, 24, kv_host_memory=200 * per_block(llama_dir), preemption_mode="swap")
    got = [o.new_token_ids for o in swapping.generate(prompts, sampling)]
    assert got == want
    stats = swapping.stats()
    assert stats.num_swapped > 0 and stats.num_swapped == stats.num_preemptions
    assert stats.prompt_tokens_computed < recompute.stats().prompt_tokens_computed
    assert stats.tiers.swapped == 0  # every swapped sequence came back and gave its slots up
    swapping.allocator.page_table.check()


def test_auto_preemption_measures_copies_and_prefill_at_start_and_refuses_bad_tiers(llama_dir):
    eng = engine(llama_dir, 8, kv_host_memory=16 * per_block(llama_dir))
    cost = eng.tiers.cost
    assert cost.out_bytes_per_s > 0 and cost.in_bytes_per_s > 0 and cost.prefill_tokens_per_s > 0
    assert eng.stats().tiers.host_blocks == 16
    assert engine(llama_dir, 8, kv_host_memory=16 * per_block(llama_dir), preemption_mode="recompute").tiers.cost is None
    with pytest.raises(ValueError, match="holds no KV block"):
        engine(llama_dir, 8, kv_host_memory=per_block(llama_dir) - 1)
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(dtype="float32", kv_host_memory=1 << 20, kv_disk_bytes=1 << 20)
