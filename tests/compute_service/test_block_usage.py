"""What the KV cache manager tells its ``BlockUsage``: a prefix hit counts, a block handed out fresh
is forgotten (its bytes are about to change), in both KV layouts. Pure: an in-process page table."""

from __future__ import annotations

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.core.sampling import SamplingParams

BS = 16


def sequence(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=4))


def run_prompt(kv: KVCacheManager, seq: Sequence) -> None:
    """Admit ``seq`` and compute its prompt (what the engine's step does), then finish it."""
    assert kv.allocate(seq) is None
    seq.num_computed = seq.num_tokens
    kv.commit_full_blocks([seq])
    kv.release([seq])


def test_paged_commits_are_named_hits_counted_and_fresh_blocks_forgotten():
    kv = KVCacheManager(LocalBlockAllocator.standalone(4, BS, 1024))
    prompt = list(range(2 * BS + 1))
    run_prompt(kv, sequence("a", prompt))
    assert sorted(b.hits for b in kv.usage.blocks()) == [0, 0]
    run_prompt(kv, sequence("b", prompt))
    assert sorted(b.hits for b in kv.usage.blocks()) == [1, 1]
    run_prompt(kv, sequence("c", [7] * (3 * BS + 1)))  # needs every block: evicts both
    assert {b.token_ids[0] for b in kv.usage.blocks()} == {7}


def test_a_contiguous_reservation_forgets_the_cached_blocks_it_takes():
    """A contiguous node commits nothing, but a snapshot it restored is cached in its pool; a
    reservation that takes those blocks overwrites them, and a later snapshot must not name them."""
    allocator = LocalBlockAllocator.standalone(4, BS, 1024)
    paged = KVCacheManager(allocator)
    run_prompt(paged, sequence("restored", list(range(4 * BS))))
    assert len(paged.usage) == 4
    contiguous = KVCacheManager(allocator, reserve_tokens=4 * BS)
    contiguous.usage = paged.usage  # one node, one tracker
    assert contiguous.allocate(sequence("r", [1] * 10)) is None
    assert len(contiguous.usage) == 0
