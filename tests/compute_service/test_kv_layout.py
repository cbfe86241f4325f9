"""``kv_layout="contiguous"`` on the real engine (tiny model): the same tokens as paged, a reservation of
``ceil(max_model_len / block_size)`` blocks per admitted sequence held until it ends, no prefix
sharing, and a clear refusal for what can never fit. Pool counts are read through the allocator."""

from __future__ import annotations

import pytest

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.block_service.page_table import PageTable
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.kv.layout import parse_kv_layout, reserved_tokens
from kvfleet.core.sampling import SamplingParams
from kvfleet.core.tenants import Tenant
from tests.compute_service.conftest import random_prompt

BS, MAX_LEN = 16, 256
RESERVATION = MAX_LEN // BS           # blocks a contiguous sequence takes at admission
BYTES_PER_BLOCK = 2 * 4 * 2 * 32 * 4 * BS  # K and V x 4 layers x 2 KV heads x head_dim 32 x float32 (tiny preset)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def engine_for(model_dir, layout: str, num_blocks: int = 3 * RESERVATION, allocator_factory=None) -> LLMEngine:
    config = EngineConfig(dtype="float32", block_size=BS, kv_cache_memory=num_blocks * BYTES_PER_BLOCK, max_model_len=MAX_LEN,
                          kv_layout=layout)
    engine = LLMEngine(model_dir, config, allocator_factory=allocator_factory)
    assert engine.allocator.num_blocks == num_blocks
    return engine


@pytest.fixture(scope="module")
def paged(llama_dir):
    return engine_for(llama_dir, "paged")


@pytest.fixture(scope="module")
def contiguous(llama_dir):
    return engine_for(llama_dir, "contiguous")


def free_blocks(engine: LLMEngine) -> int:
    stats = engine.allocator.stats()
    assert stats.num_free + stats.num_cached + stats.num_used == stats.num_blocks
    return stats.num_free


def test_layout_names():
    assert reserved_tokens("paged", 4096) is None and reserved_tokens("contiguous", 4096) == 4096
    with pytest.raises(ValueError, match="^--kv-layout must be one of paged, contiguous, got 'ragged'$"):
        parse_kv_layout("ragged")
    with pytest.raises(ValueError, match="--kv-layout"):
        EngineConfig(dtype="float32", kv_layout="ragged")


def test_contiguous_is_token_identical_to_paged(paged, contiguous):
    """Six requests of different lengths at once; the pool holds three reservations, so half of
    them wait for the first to finish (admission queues) while paged runs them all together."""
    prompts = [random_prompt(n, seed=n) for n in (5, 40, 100, 17, 63, 150)]
    sampling = [SamplingParams(max_tokens=k, ignore_eos=True) for k in (6, 14, 5, 10, 8, 18)]
    for engine in (paged, contiguous):
        for i, (prompt, params) in enumerate(zip(prompts, sampling)):
            engine.add_request(f"{engine.config.kv_layout}-{i}", prompt, params)
    outs = {}
    most_running = {}
    for engine in (paged, contiguous):
        layout = engine.config.kv_layout
        most_running[layout] = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                outs.setdefault(out.request_id, []).extend(out.new_token_ids)
            most_running[layout] = max(most_running[layout], engine.stats().num_running)
    for i, params in enumerate(sampling):
        assert len(outs[f"paged-{i}"]) == params.max_tokens
        assert outs[f"contiguous-{i}"] == outs[f"paged-{i}"], i
    assert most_running == {"paged": 6, "contiguous": 3}
    assert free_blocks(contiguous) == contiguous.allocator.num_blocks


def test_reservation_taken_at_admission_and_given_back(contiguous):
    """Each running sequence holds exactly its reservation from admission on; the pool's used
    blocks are the running sequences' reservations at every step; a finished, an aborted running
    and an aborted waiting request all leave the pool whole."""
    engine = contiguous
    for i, n in enumerate((10, 70, 33, 120)):
        engine.add_request(f"r{i}", random_prompt(n, seed=40 + i), SamplingParams(max_tokens=8 + 4 * i, ignore_eos=True))
    engine.step()
    running = {s.seq_id: s for s in engine.scheduler.running}
    assert sorted(running) == ["r0", "r1", "r2"] and [s.seq_id for s in engine.scheduler.waiting] == ["r3"]
    for seq in running.values():
        assert len(seq.block_table) == RESERVATION and seq.num_allocated_tokens == MAX_LEN
    assert engine.allocator.stats().num_used == 3 * RESERVATION and free_blocks(engine) == 0

    engine.abort_request("r3")  # waiting: held nothing
    engine.abort_request("r1")  # running: its whole reservation comes back
    assert engine.allocator.stats().num_used == 2 * RESERVATION
    while engine.has_unfinished_requests():
        engine.step()
        assert engine.allocator.stats().num_used == RESERVATION * len(engine.scheduler.running)
    stats = engine.allocator.stats()
    assert (stats.num_free, stats.num_cached, stats.num_used) == (stats.num_blocks, 0, 0)


def test_no_prefix_sharing(paged, contiguous):
    """The same 64-token prompt twice: paged serves the second from the cache, contiguous
    neither looks up nor commits anything."""
    prompt = random_prompt(64, seed=99)
    for engine in (paged, contiguous):
        before = engine.allocator.stats()
        first, second = (engine.generate([prompt], GREEDY)[0] for _ in range(2))
        after = engine.allocator.stats()
        assert second.new_token_ids == first.new_token_ids
        if engine is paged:
            assert second.cached_tokens == 48 and after.prefix_hits > before.prefix_hits
        else:
            assert (first.cached_tokens, second.cached_tokens) == (0, 0)
            assert (after.prefix_queries, after.prefix_hits) == (before.prefix_queries, before.prefix_hits)
            assert after.num_cached == 0 and after.num_free == after.num_blocks


def test_a_reservation_larger_than_the_pool_is_refused_at_start(llama_dir):
    with pytest.raises(ValueError, match=r"^--kv-layout contiguous reserves max_model_len 256 tokens \(16 blocks "
                                         r"of 16\) per sequence, but the pool holds 15 blocks: lower --max-model-len"):
        engine_for(llama_dir, "contiguous", num_blocks=RESERVATION - 1)
    engine_for(llama_dir, "paged", num_blocks=RESERVATION - 1)  # paged runs there


def test_too_large_requests_are_refused_not_queued(llama_dir):
    """A prompt past max_model_len is refused at once; a tenant whose quota cannot hold one
    reservation is refused with its quota named (RESOURCE_EXHAUSTED at the node), not left
    waiting, and takes nothing from the pool."""
    table = PageTable()

    def factory(num_blocks: int, block_size: int, bytes_per_block: int) -> LocalBlockAllocator:
        table.register_node("local", num_blocks, block_size, bytes_per_block)
        table.configure_tenants([Tenant("small", quota_mib=(RESERVATION - 1) * bytes_per_block / 2**20)])
        return LocalBlockAllocator(table, "local")

    engine = engine_for(llama_dir, "contiguous", allocator_factory=factory)
    with pytest.raises(ValueError, match="max_model_len is 256"):
        engine.add_request("long", random_prompt(MAX_LEN, seed=1), GREEDY)
    engine.add_request("capped", random_prompt(20, seed=2), GREEDY, tenant="small")
    engine.add_request("fine", random_prompt(20, seed=2), GREEDY)
    outs = {}
    for _ in range(40):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    capped = outs["capped"][-1]
    assert capped.finished and capped.finish_reason == "abort" and capped.refusal.reason == "quota"
    assert capped.refusal.blocks_asked == RESERVATION and not any(o.new_token_ids for o in outs["capped"])
    assert outs["fine"][-1].finish_reason == "length"
    assert free_blocks(engine) == engine.allocator.num_blocks
    table.check()
