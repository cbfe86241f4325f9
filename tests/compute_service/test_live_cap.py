"""The controller on a node's step thread: token gaps from step outputs, the cap into the scheduler."""

from __future__ import annotations

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.compute_service.engine.batch_controller import BatchController, ControllerConfig
from kvfleet.compute_service.engine.live_cap import LiveCap
from kvfleet.compute_service.engine.request_output import RequestOutput
from kvfleet.compute_service.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.core.sampling import SamplingParams


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def out(rid, finished=False):
    return RequestOutput(rid, new_token_ids=[1], finished=finished)


def test_gaps_between_a_requests_tokens_set_the_schedulers_cap():
    allocator = LocalBlockAllocator.standalone(64, 16, bytes_per_block=1024)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4), KVCacheManager(allocator))
    for i in range(4):
        sched.add(Sequence(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100)))
    sched.schedule()  # 4 running: the cap is reached
    clock = Clock()
    live = LiveCap(BatchController(ControllerConfig(0.05, 4, interval_s=1.0, min_samples=8), clock()), sched,
                   clock=clock)
    assert live.cap == sched.num_seqs_cap == 4
    for _ in range(4):  # a step every 0.125 s: 125 ms gaps, over the 50 ms target
        clock.now += 0.125
        live.after_step([out(f"r{i}") for i in range(4)])
    assert live.last_decision is None  # not due yet
    for _ in range(4):
        clock.now += 0.125
        live.after_step([out(f"r{i}") for i in range(4)])
    decision = live.last_decision  # at 1 s, after 8 steps: the first tokens are not gaps
    assert decision.num_samples == 7 * 4 and decision.p99_s == 0.125
    assert live.cap == sched.num_seqs_cap == 3


def test_a_finished_request_leaves_no_gap_behind():
    allocator = LocalBlockAllocator.standalone(64, 16, bytes_per_block=1024)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4), KVCacheManager(allocator))
    clock = Clock()
    live = LiveCap(BatchController(ControllerConfig(0.05, 4, interval_s=1.0, min_samples=1), 0.0), sched,
                   clock=clock)
    live.after_step([out("a")])
    live.after_step([out("a", finished=True)])
    clock.now = 0.9  # "a" again (a new request reusing the id) is a first token, not a 0.9 s gap
    live.after_step([out("a")])
    clock.now = 1.0
    live.after_step([])
    assert live.last_decision.p99_s == 0.0 and live.last_decision.num_samples == 1


def test_a_step_that_filled_its_token_budget_lets_the_cap_grow():
    """Under long prompts the step's token budget (which follows the cap) binds before the number of
    sequences does: the scheduler's full step reaches the controller, and a fast node grows."""
    allocator = LocalBlockAllocator.standalone(64, 16, bytes_per_block=1024)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8), KVCacheManager(allocator))
    for i in range(4):
        sched.add(Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=100)))
    sched.schedule()  # 4 running, 8 tokens
    clock = Clock()
    live = LiveCap(BatchController(ControllerConfig(0.05, 4, interval_s=1.0, min_samples=4, probe_intervals=1),
                                   clock()), sched, clock=clock)
    for _ in range(8):  # slow: cut to 3, and each step to ⌈8 · 3 / 4⌉ = 6 tokens
        clock.now += 0.125
        live.after_step([out(f"r{i}") for i in range(4)])
    assert live.cap == 3 and sched.step_token_budget == 6
    sched.finish(sched.running[1:])
    sched.add(Sequence("long", list(range(40)), SamplingParams(max_tokens=100)))
    batch = sched.schedule()  # r0's token and a 5-token chunk of the long prompt: 2 of 3 seats, budget full
    assert batch.num_tokens == 6 and len(sched.running) == 2 and sched.budget_used_up
    for _ in range(120):  # fast steps at 2 of 3 seats, the budget full: reached
        clock.now += 0.01
        live.after_step([out("r0")])
    assert live.cap == sched.num_seqs_cap == 4
