"""Sharing a prefix another sequence on the node is prefilling right now (pure Python, no model).

A block is found in the prefix cache only once committed, after the step that writes it. Two
requests with the same long prefix admitted in one step would both compute it; the scheduler holds
the second until the first has committed the shared blocks, and the remote allocator's early grant
(asked when the request arrived, before those commits) is asked again so the hit is not lost.
"""

from __future__ import annotations

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.compute_service.blocks.allocator_policy import AllocatorPolicy
from kvfleet.compute_service.blocks.recent_commits import RecentCommits
from kvfleet.compute_service.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.sampling import SamplingParams

BS = 16
SYSTEM = list(range(1000, 1000 + 4 * BS))  # a shared prefix of four blocks


def make_scheduler(budget=512, max_seqs=8, num_blocks=64, reserve_tokens=None):
    allocator = LocalBlockAllocator.standalone(num_blocks, BS, bytes_per_block=1024)
    kv = KVCacheManager(allocator, reserve_tokens=reserve_tokens)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096), kv), kv


def seq(seq_id, tokens):
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=8))


def run_step(sched, kv, batch):
    """What the engine does after a forward pass: tokens computed, full blocks committed, one token
    sampled where a prompt was finished."""
    stepped = [s for s, _ in batch.prefills] + batch.decodes
    for s, n in batch.prefills + [(d, 1) for d in batch.decodes]:
        s.num_computed += n
    kv.commit_full_blocks(stepped)
    for s in stepped:
        if s.num_computed == s.num_tokens:
            s.token_ids.append(7)


def test_a_request_sharing_a_prefix_being_prefilled_waits_for_its_commit_and_hits():
    sched, kv = make_scheduler()
    first, second = seq("first", SYSTEM + [1] * 20), seq("second", SYSTEM + [2] * 30)
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.prefills] == ["first"]  # second would compute the prefix again
    assert [s.seq_id for s in sched.waiting] == ["second"]
    run_step(sched, kv, batch)
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("second", 30)]  # the four blocks cached
    assert [s.seq_id for s in batch.decodes] == ["first"]
    assert second.num_cached_tokens == 4 * BS


def test_a_sharer_waits_for_the_last_chunk_of_a_prefix_and_gets_all_of_it():
    sched, kv = make_scheduler(budget=3 * BS)
    first, second = seq("first", SYSTEM + [1] * 4), seq("second", SYSTEM + [2] * 30)
    sched.add(first)
    sched.add(second)
    admitted_at = None
    for step in range(10):
        batch = sched.schedule()
        if any(s is second for s, _ in batch.prefills):
            admitted_at = step
            break
        run_step(sched, kv, batch)
    # step 0: first's three blocks; step 1: its last chunk (the fourth block) leaves budget to spare
    assert admitted_at == 2
    assert second.num_cached_tokens == 4 * BS


def test_others_are_admitted_while_a_sharer_waits():
    sched, kv = make_scheduler()
    sched.add(seq("first", SYSTEM + [1] * 20))
    sched.add(seq("second", SYSTEM + [2] * 30))
    sched.add(seq("other", range(5000, 5000 + 3 * BS)))
    batch = sched.schedule()
    assert sorted(s.seq_id for s, _ in batch.prefills) == ["first", "other"]
    assert [s.seq_id for s in sched.waiting] == ["second"]


def test_a_prefix_already_committed_or_unshared_is_no_reason_to_wait():
    sched, kv = make_scheduler()
    first = seq("first", SYSTEM + [1] * 20)
    sched.add(first)
    run_step(sched, kv, sched.schedule())
    sched.add(seq("second", SYSTEM + [2] * 30))            # first's prefix is committed: a hit now
    sched.add(seq("third", [3] * 40))
    batch = sched.schedule()
    assert sorted(s.seq_id for s, _ in batch.prefills) == ["second", "third"]


def test_the_contiguous_layout_shares_nothing_and_holds_nothing():
    sched, _ = make_scheduler(reserve_tokens=8 * BS)
    sched.add(seq("first", SYSTEM + [1] * 20))
    sched.add(seq("second", SYSTEM + [2] * 30))
    assert sorted(s.seq_id for s, _ in sched.schedule().prefills) == ["first", "second"]


def test_an_early_grant_is_asked_again_when_its_missing_prefix_was_committed_since():
    hashes = [bytes([i]) * 16 for i in range(4)]
    policy = AllocatorPolicy(BS)
    policy.ask(AllocateRequest("n0", "b", "t", hashes, 5 * BS))
    asks = policy.take_asks()
    policy.fold_asks(asks, [Allocation([10, 11, 12, 13, 14], 0)])  # asked before "a" committed anything
    policy.claim("a", "t", Allocation([0, 1, 2, 3, 4], 0), 5 * BS)
    policy.commit([("a", i, h) for i, h in enumerate(hashes)])
    assert policy.allocate("b", hashes, 5 * BS) is None  # stale: the engine asks block_service now
    assert "b" in policy.take().releases                  # the stale grant is given back first


def test_an_early_grant_that_saw_every_commit_is_claimed():
    hashes = [bytes([i]) * 16 for i in range(4)]
    policy = AllocatorPolicy(BS)
    policy.claim("a", "t", Allocation([0, 1, 2, 3, 4], 0), 5 * BS)
    policy.commit([("a", i, h) for i, h in enumerate(hashes[:2])])
    policy.ask(AllocateRequest("n0", "b", "t", hashes, 5 * BS))
    asks = policy.take_asks()                              # sent after those two commits
    grant = Allocation([0, 1, 12, 13, 14], 2)
    policy.fold_asks(asks, [grant])
    assert policy.allocate("b", hashes, 5 * BS) == grant


def test_recent_commits_are_numbered_and_bounded():
    commits = RecentCommits(max_entries=2)
    commits.record([b"a"])
    mark = commits.mark()
    commits.record([b"b", b"c"])
    assert commits.committed_since(b"b", mark) and not commits.committed_since(b"a", mark)
    commits.record([b"a"])                                  # committed again: newer than the mark
    assert commits.committed_since(b"a", mark) and not commits.committed_since(b"b", mark)  # b forgotten


def test_a_sharer_proceeds_when_the_prefill_it_waits_for_ends_without_committing():
    sched, kv = make_scheduler(budget=2 * BS)
    first, second = seq("first", SYSTEM + [1] * 4), seq("second", SYSTEM + [2] * 30)
    sched.add(first)
    sched.add(second)
    run_step(sched, kv, sched.schedule())                  # first's two leading blocks, second held
    assert [s.seq_id for s in sched.waiting] == ["second"]
    sched.finish([first])                                  # aborted before its last two blocks
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("second", 2 * BS)]
    assert second.num_cached_tokens == 2 * BS              # what first committed, the rest its own
