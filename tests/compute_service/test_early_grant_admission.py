"""Early grants never starve the head of the queue (the scheduler on the remote allocator, against a
real BlockManager server: served_blocks.py).

A request's first blocks are asked for when it reaches the node, before the scheduler admits it.
When requests queue, their grants hold the pool while the head of the queue (a preempted
sequence, or one whose early ask found the pool full or was given back as stale) has none: its ask
is refused for the pool, with blocks "held elsewhere", and it waits; those behind it are not
admitted while it waits, so their grants are never claimed and the node would wait forever with
nothing running. The head's ask takes those grants back instead.
"""

from __future__ import annotations

from kvfleet.compute_service.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.served_blocks import BS, check_agrees, num_sequences


def seq(seq_id: str, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(max_tokens=4), tenant="t")


def test_grants_of_queued_requests_give_way_to_the_head_that_has_none(node):
    allocator, on_loop, client = node  # a pool of 64 blocks
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096, max_model_len=4096),
                      KVCacheManager(allocator))
    head = seq("head", [1] * (20 * BS))          # arrived first: no early grant (as after a preemption)
    behind = [seq(f"q{i}", [10 + i] * (28 * BS)) for i in range(2)]
    for s in behind:                             # their grants (and reserves) take 58 of the 64 blocks
        on_loop(allocator.preallocate(s.seq_id, "t", s.token_ids))
    assert num_sequences(on_loop, client) == 2
    for s in (head, *behind):
        sched.add(s)

    admitted = []
    for _ in range(3):
        batch = sched.schedule()
        admitted += [s.seq_id for s, _ in batch.prefills]
        allocator.end_step()
        on_loop(allocator.settle())
        if admitted:
            break
    # nothing ran before (the node was stuck); the head first, then what fits beside it, asked again
    assert admitted == ["head", "q0"]
    assert [s.seq_id for s in sched.waiting] == ["q1"]
    on_loop(allocator.flush())
    check_agrees(allocator, on_loop, client)     # q1's grant went back: block_service holds 2 sequences
