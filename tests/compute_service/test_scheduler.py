"""Scheduler policy on the real in-process allocator (pure Python, no model)."""

from __future__ import annotations

import pytest

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.compute_service.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.compute_service.engine.sequence import Sequence, Status
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.core.allocator import Refusal
from kvfleet.core.sampling import SamplingParams


def make_scheduler(num_blocks=64, block_size=16, budget=64, max_seqs=8, long_prefill=0, step_rows=None):
    allocator = LocalBlockAllocator.standalone(num_blocks, block_size, bytes_per_block=1024)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=4096,
                                     long_prefill_token_threshold=long_prefill, step_rows=step_rows),
                     KVCacheManager(allocator)), allocator


def seq(seq_id, length, priority=0, start=0):
    return Sequence(seq_id, list(range(start, start + length)), SamplingParams(max_tokens=100), priority=priority)


def advance(batch):
    """What the engine does after a forward pass: mark tokens computed, sample one token when a
    sequence's chunk reached its end."""
    for s, n in batch.prefills + [(d, 1) for d in batch.decodes]:
        s.num_computed += n
        if s.num_computed == s.num_tokens:
            s.token_ids.append(7)


def test_long_prompt_is_prefilled_in_chunks_within_the_budget():
    sched, _ = make_scheduler(budget=64)
    long = seq("long", 150)
    sched.add(long)
    chunks = []
    while long.num_computed < 150:
        batch = sched.schedule()
        assert batch.num_tokens <= 64
        chunks.append(batch.prefills[0][1])
        advance(batch)
    assert chunks == [64, 64, 22]


def test_decodes_and_prefill_chunks_share_a_step():
    sched, _ = make_scheduler(budget=40)
    sched.add(seq("a", 10))
    advance(sched.schedule())                   # a prefilled
    sched.add(seq("b", 100, start=1000))
    batch = sched.schedule()
    assert [s.seq_id for s in batch.decodes] == ["a"]
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("b", 39)]


def test_higher_priority_is_admitted_first():
    sched, _ = make_scheduler(budget=16, max_seqs=1)
    sched.add(seq("low", 8, priority=0))
    sched.add(seq("high", 8, priority=5, start=100))
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.prefills] == ["high"]


def test_admission_waits_for_blocks():
    sched, allocator = make_scheduler(num_blocks=4, budget=256)
    sched.add(seq("a", 60))                     # 4 blocks: the whole pool
    sched.add(seq("b", 20, start=500))
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.prefills] == ["a"]
    assert [s.seq_id for s in sched.waiting] == ["b"]
    allocator.page_table.check()


def test_preemption_takes_the_lowest_priority_newest_and_keeps_its_tokens():
    sched, allocator = make_scheduler(num_blocks=6, budget=256)
    important, old, new = seq("important", 32, priority=1), seq("old", 16, start=100), seq("new", 16, start=200)
    for s in (important, old, new):
        sched.add(s)
    advance(sched.schedule())                   # 2 + 1 + 1 blocks, each sampled a token: all need growth
    generated = list(new.token_ids)
    batch = sched.schedule()                    # 3 more blocks wanted, 2 free: "new" gives way
    assert [s.seq_id for s in batch.preempted] == ["new"]
    assert new.status is Status.WAITING and new.num_computed == 0 and new.token_ids == generated
    assert {s.seq_id for s in batch.decodes} == {"important", "old"}
    allocator.page_table.check()


def test_a_sequence_too_big_for_the_pool_is_refused_not_looped():
    sched, _ = make_scheduler(num_blocks=2, budget=256)
    sched.add(seq("huge", 40))                  # 3 blocks > 2
    batch = sched.schedule()
    assert [(s.seq_id, r.reason) for s, r in batch.refused] == [("huge", "pool")]
    assert not sched.has_unfinished()


def test_a_tenant_over_quota_does_not_hold_back_others():
    from kvfleet.core.tenants import Tenant

    sched, allocator = make_scheduler(num_blocks=64, budget=512)
    # bytes_per_block is 1024: a 4 KiB quota is 4 blocks
    allocator.page_table.configure_tenants([Tenant("small", quota_mib=4 / 1024)])
    first = seq("s1", 60)
    first.tenant = "small"
    second = seq("s2", 60, start=100)
    second.tenant = "small"
    other = seq("o1", 60, start=200)
    for s in (first, second, other):
        sched.add(s)
    batch = sched.schedule()
    assert {s.seq_id for s, _ in batch.prefills} == {"s1", "o1"}
    assert [s.seq_id for s in sched.waiting] == ["s2"]      # waits for its tenant's blocks
    too_big = seq("s3", 100, start=300)
    too_big.tenant = "alone"
    allocator.page_table.configure_tenants([Tenant("alone", quota_mib=2 / 1024)])
    sched.add(too_big)
    batch = sched.schedule()
    assert [(s.seq_id, r.reason) for s, r in batch.refused] == [("s3", "quota")]


class Unreachable:
    """The in-process allocator behind a switch: while ``down``, every call that needs an answer
    gets the transient refusal a node gets when block_service does not answer."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.block_size, self.num_blocks = allocator.block_size, allocator.num_blocks
        self.down = False

    def allocate(self, seq_id, tenant, block_hashes, num_tokens):
        if self.down:
            return Refusal.unavailable("n0", tenant)
        return self.allocator.allocate(seq_id, tenant, block_hashes, num_tokens)

    def extend(self, growth):
        if self.down:
            return [Refusal.unavailable("n0") for _ in growth]
        return self.allocator.extend(growth)

    def commit(self, commits):
        self.allocator.commit(commits)

    def release(self, seq_ids):
        self.allocator.release(seq_ids)


def make_unreachable(num_blocks=64, budget=256):
    local = LocalBlockAllocator.standalone(num_blocks, 16, bytes_per_block=1024)
    allocator = Unreachable(local)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=4096),
                      KVCacheManager(allocator))
    return sched, allocator, local


def test_an_unreachable_block_service_makes_admission_wait_without_refusing():
    sched, allocator, local = make_unreachable()
    allocator.down = True
    sched.add(seq("a", 20))
    for _ in range(3):
        batch = sched.schedule()
        assert batch.is_empty and not batch.refused and not batch.preempted
    assert [s.seq_id for s in sched.waiting] == ["a"] and not sched.running
    allocator.down = False
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("a", 20)]
    local.page_table.check()


def test_a_running_sequence_that_cannot_grow_sits_out_without_preempting_others():
    sched, allocator, local = make_unreachable()
    low, high = seq("low", 16), seq("high", 16, priority=5, start=100)
    for s in (low, high):
        sched.add(s)
    advance(sched.schedule())                   # one full block each, a token sampled: both must grow
    allocator.down = True
    batch = sched.schedule()
    assert batch.is_empty and not batch.preempted and not batch.refused
    assert {s.seq_id for s in sched.running} == {"low", "high"}
    assert all(s.status is Status.RUNNING and s.num_computed == 16 for s in (low, high))
    allocator.down = False
    batch = sched.schedule()
    assert {s.seq_id for s in batch.decodes} == {"low", "high"} and not batch.preempted
    local.page_table.check()


def _held_elsewhere(allocator, seq_id, tenant, num_blocks):
    """Blocks charged to ``tenant`` on this node by a sequence the scheduler does not run (a
    request's early allocation, or a release not yet applied), as the remote allocator holds them."""
    allocator.page_table.allocate(allocator.node_id, seq_id, tenant, [], num_blocks * 16)


def test_a_quota_held_by_sequences_the_scheduler_does_not_run_makes_a_request_wait_not_fail():
    """Seen in the chaos suite: a small tenant's request that fits its quota alone was refused
    ("asked 21 blocks, 15 charged of 32 allowed") because the blocks were held by early
    allocations of the same tenant's requests still arriving."""
    from kvfleet.core.tenants import Tenant

    sched, allocator = make_scheduler(num_blocks=64, budget=512)
    allocator.page_table.configure_tenants([Tenant("small", quota_mib=4 / 1024)])  # 4 blocks
    _held_elsewhere(allocator, "early", "small", 3)
    waiting = seq("s1", 40)  # 3 blocks: fits the quota alone, not next to the 3 held
    waiting.tenant = "small"
    sched.add(waiting)
    batch = sched.schedule()
    assert batch.refused == [] and sched.waiting == [waiting]
    allocator.release(["early"])
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.prefills] == ["s1"]


def test_a_running_sequence_alone_steps_back_for_blocks_held_elsewhere():
    from kvfleet.core.tenants import Tenant

    sched, allocator = make_scheduler(num_blocks=64, budget=512)
    allocator.page_table.configure_tenants([Tenant("small", quota_mib=4 / 1024)])  # 4 blocks
    running = seq("s1", 32)
    running.tenant = "small"
    sched.add(running)
    advance(sched.schedule())  # 2 blocks for 32 tokens + 1 sampled: a third is needed
    _held_elsewhere(allocator, "early", "small", 2)
    batch = sched.schedule()
    assert batch.refused == [] and [s.seq_id for s in batch.preempted] == ["s1"]
    allocator.release(["early"])
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.prefills] == ["s1"] and batch.refused == []


def test_a_request_over_its_quota_on_its_own_is_still_refused_next_to_blocks_held_elsewhere():
    from kvfleet.core.tenants import Tenant

    sched, allocator = make_scheduler(num_blocks=64, budget=512)
    allocator.page_table.configure_tenants([Tenant("small", quota_mib=4 / 1024)])
    _held_elsewhere(allocator, "early", "small", 1)
    too_big = seq("s1", 100)  # 7 blocks: never fits 4
    too_big.tenant = "small"
    sched.add(too_big)
    batch = sched.schedule()
    assert [(s.seq_id, r.reason) for s, r in batch.refused] == [("s1", "quota")]


def test_the_live_cap_limits_admission_and_lets_running_sequences_finish():
    sched, _ = make_scheduler(budget=64, max_seqs=4)
    for i in range(4):
        sched.add(seq(f"s{i}", 4, start=10 * i))
    advance(sched.schedule())
    assert len(sched.running) == 4
    sched.set_num_seqs_cap(2)  # lowered below what runs: nobody is preempted
    sched.add(seq("late", 4, start=100))
    batch = sched.schedule()
    assert len(batch.decodes) == 4 and not batch.prefills and not batch.preempted
    sched.finish(sched.running[:3])  # one left running: one more may join, up to the cap of 2
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.prefills] == ["late"] and len(sched.running) == 2
    for bad in (0, 5):
        with pytest.raises(ValueError, match="live cap"):
            sched.set_num_seqs_cap(bad)


def test_the_step_token_budget_follows_the_live_cap():
    """A burst of admissions prefills its prompts in one step; the steps that set the tail. With the
    cap halved the step takes half the budget, so the burst spreads over steps."""
    sched, _ = make_scheduler(budget=64, max_seqs=8)
    sched.set_num_seqs_cap(4)
    for i in range(4):
        sched.add(seq(f"s{i}", 16, start=100 * i))
    batch = sched.schedule()
    assert [s.seq_id for s, _ in batch.prefills] == ["s0", "s1"] and len(sched.waiting) == 2
    assert sched.step_token_budget == 32 and batch.num_tokens == 32 and sched.budget_used_up
    advance(batch)
    batch = sched.schedule()  # two decodes, then the next prompts within what is left
    assert len(batch.decodes) == 2 and [(s.seq_id, n) for s, n in batch.prefills] == [("s2", 16), ("s3", 14)]
    sched.set_num_seqs_cap(3)  # rounded up: 64 * 3 / 8 = 24
    assert sched.step_token_budget == 24
    sched.set_num_seqs_cap(8)  # at the maximum, the configured budget: as without a controller
    assert sched.step_token_budget == 64
    advance(batch)
    batch = sched.schedule()
    assert batch.num_tokens == 5 and not sched.budget_used_up


def test_a_batch_draining_above_a_lowered_cap_keeps_its_decodes():
    """The budget follows the cap, but sequences already running above it are not starved of their
    tokens while they drain: a step carries all their decodes, and no prompt."""
    sched, _ = make_scheduler(budget=8, max_seqs=8)
    for i in range(8):
        sched.add(seq(f"s{i}", 1, start=10 * i))
    advance(sched.schedule())
    sched.set_num_seqs_cap(2)  # a budget of 2 tokens a step
    sched.add(seq("late", 4, start=100))
    batch = sched.schedule()
    assert len(batch.decodes) == 8 and not batch.prefills and sched.budget_used_up
