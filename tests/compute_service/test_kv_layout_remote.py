"""The contiguous layout's reservation through the remote allocator, against a real BlockManager
server (served_blocks.py): asked early as the engine will ask it, charged whole at block_service,
no reserve block past ``max_model_len``, nothing committed, all given back at the release."""

from __future__ import annotations

from kvfleet.core.allocator import Allocation
from tests.compute_service.served_blocks import check_agrees, held

MAX_LEN = 160  # 10 blocks of 16


def test_a_contiguous_reservation_is_asked_early_and_held_whole(node):
    allocator, on_loop, client = node
    allocator.cap_length(MAX_LEN)
    on_loop(allocator.preallocate("a", "t", list(range(40)), reserve_tokens=MAX_LEN))
    rpcs = allocator.num_rpcs
    got = allocator.allocate("a", "t", [], MAX_LEN)  # what KVCacheManager asks when contiguous
    assert isinstance(got, Allocation) and (len(got.block_ids), got.num_cached_blocks) == (10, 0)
    assert allocator.num_rpcs == rpcs  # answered from the early ask: the same request
    assert allocator.extend([("a", MAX_LEN)]) == [[]]
    allocator.end_step()
    on_loop(allocator.flush())
    seq = held(on_loop, client, "a")
    assert (seq.block_ids, seq.num_tokens) == (got.block_ids, MAX_LEN)  # no reserve block beyond it
    check_agrees(allocator, on_loop, client)
    assert pool(on_loop, client) == (54, 0, 10)
    allocator.release(["a"])  # finished or aborted alike: the engine releases the sequence
    allocator.end_step()
    on_loop(allocator.flush())
    assert pool(on_loop, client) == (64, 0, 0) and not allocator.live_sequences()


def pool(on_loop, client) -> tuple[int, int, int]:
    """block_service's (free, cached, used) blocks of the node's pool."""
    [node], _ = on_loop(client.stats(["n0"]))
    return node.num_free, node.num_cached, node.num_used
