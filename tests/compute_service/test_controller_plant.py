"""The P99 controller closing the loop around the real scheduler, on a simulated clock: the issue's
goal (p99 within target + 10% after settling, at >= 85% of the uncontrolled throughput) as logic.

The plant: a step takes ``BASE_S + PER_TOKEN_S · tokens`` (a CPU's matmuls: the time of a step is its
tokens'), the scheduler and ``LiveCap`` are the node's own, closed-loop clients send a 32-token
prompt for 32 tokens and the next, joining over the first 30 s (the bench's workload without its
host). Nothing sleeps and nothing is timed: time is the plant's.
"""

from __future__ import annotations

from kvfleet.block_service.local_allocator import LocalBlockAllocator
from kvfleet.compute_service.engine.batch_controller import BatchController, ControllerConfig, p99
from kvfleet.compute_service.engine.live_cap import LiveCap
from kvfleet.compute_service.engine.request_output import RequestOutput
from kvfleet.compute_service.engine.scheduler import Scheduler, SchedulerConfig
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.core.sampling import SamplingParams

BASE_S, PER_TOKEN_S = 0.004, 0.002
PROMPT, OUTPUT, MAX_NUM_SEQS = 32, 32, 64
SECONDS, SETTLED_FROM = 150.0, 90.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(budget: int, clients: int, target_s: float | None = None) -> tuple[float, int]:
    """p99 ITL and tokens generated over the settled window, with the controller when ``target_s``."""
    allocator = LocalBlockAllocator.standalone(2048, 16, bytes_per_block=1024)
    sched = Scheduler(SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=budget),
                      KVCacheManager(allocator))
    clock = Clock()
    live = None
    if target_s is not None:
        live = LiveCap(BatchController(ControllerConfig(target_s, MAX_NUM_SEQS), 0.0), sched, clock=clock)
    sent, joined = 0, 0
    last: dict[str, float] = {}
    itls, tokens = [], 0

    def send() -> None:
        nonlocal sent
        prompt = [(sent * PROMPT + j) % 30_000 + 1 for j in range(PROMPT)]  # no two alike: no prefix hits
        sched.add(Sequence(f"r{sent}", prompt, SamplingParams(max_tokens=OUTPUT)))
        sent += 1

    while clock.now < SECONDS:
        while joined < clients and joined * 30.0 / clients <= clock.now:
            send()
            joined += 1
        batch = sched.schedule()
        clock.now += BASE_S + PER_TOKEN_S * batch.num_tokens
        outputs, done = [], []
        for seq, n in batch.prefills + [(s, 1) for s in batch.decodes]:
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                continue  # a prompt chunk: no token yet
            seq.token_ids.append(1)
            finished = seq.num_output_tokens >= OUTPUT
            outputs.append(RequestOutput(seq.seq_id, new_token_ids=[1], finished=finished))
            if clock.now >= SETTLED_FROM:
                tokens += 1
                if seq.seq_id in last:
                    itls.append(clock.now - last[seq.seq_id])
            last[seq.seq_id] = clock.now
            if finished:
                done.append(seq)
        sched.finish(done)
        for _ in done:
            send()
        if live is not None:
            live.after_step(outputs)
    return p99(itls), tokens


def test_the_controller_holds_the_target_at_85_percent_of_the_throughput():
    """A target halfway between the batch-1 and the saturated p99 (the bench's). Each step's token
    budget follows the cap, so the tail (steps that prefill several prompts at once) falls with the
    batch; with a budget fixed at 128 the cap had to fall to a handful of sequences (about 0.7 of
    the throughput) before the prompt chunks of a step stopped setting the p99."""
    budget = 2 * MAX_NUM_SEQS
    batch1, _ = run(budget, clients=1)
    saturated, uncontrolled = run(budget, clients=96)
    target = batch1 + 0.5 * (saturated - batch1)
    controlled_p99, controlled = run(budget, clients=96, target_s=target)
    assert controlled_p99 <= 1.1 * target, (controlled_p99, target)
    assert controlled >= 0.85 * uncontrolled, (controlled, uncontrolled)
