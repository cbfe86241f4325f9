"""Continuous batching policy: which sequences run this step and how many tokens each. Pure Python.

Each step fills a token budget: running sequences first (a decode token each, or their next
prefill chunk), then waiting ones by priority (highest first, then oldest). A running sequence that
cannot grow takes the blocks of the lowest-priority, newest running sequence, which is preempted
(its KV dropped, its tokens kept) and requeued to be recomputed; committed blocks stay in the
prefix cache, so recomputation usually starts from a prefix hit. With a host tier, the victim's KV
may be swapped out instead and copied back at re-admission (``KVCacheManager.preempt``: the cost
model of swap_cost.py decides).

A waiting sequence whose leading blocks another sequence of this step is prefilling right now
(same prefix, not committed yet) is held back: admitted in the same step, it would compute them
again, because a block is only found in the prefix cache once committed, after the step that
writes it. It is admitted as soon as those blocks are committed (at most as long as that prefill
lasts) with them as a cache hit. Sequences behind it are admitted meanwhile, and the batch is never
idle for it: the prefill it waits for is in the batch.

With ``long_prefill_token_threshold`` T > 0, a prompt with more than T tokens left to compute is
*long*. Short prompts (running or admitted) go first, each whole: the first of a step always, more
while the step's prompt tokens stay within T (the others wait a step, holding their blocks). A long
prompt's chunk is T when the step has no other prompt tokens, else one block. So a question that
arrives while a document is being prefilled waits for the step in progress (about T tokens), not
for the document, and its own step is as small as it can be: on a CPU a prefill step costs in
proportion to its tokens, so prompts computed one after the other give the first its token sooner
and the last no later than computed together, and the document, whose every token is computed
before its first one either way, finishes about when it would have (measured on
``bench/routing.py``: short turns had waited ~0.13 s for steps of 128-160 tokens that their ~75
shared). A step that carries a long prompt alone computes T tokens (vLLM's knob, with short prompts
let ahead as its partial-prefill limits do). Whether a prompt is long is decided by what is left
after its prefix-cache hit: a later turn of a long conversation whose history is cached is short.

A step's matmuls may compute more rows than its tokens (``step_rows``: oneDNN on CPU is handed a
few row counts only, so 131 tokens cost what 160 do, ``cpu_linear.padded_rows``). A step carrying a
long prompt is then trimmed from that prompt's chunk to the nearest row count computed as it is
(131 tokens: 128), so no step pays for rows of zeros: measured on bench-small, a 128-token chunk
beside three decodes took 115 ms against 98 ms alone.

A transient refusal (block_service unreachable) is neither a full pool nor a quota: nothing is
preempted or refused for it. A waiting sequence stays at the head of the queue; a running one
that cannot grow sits this step out, holding its blocks, and is scheduled again once they come.

The P99 batch controller's live cap (``set_num_seqs_cap``) bounds the batch in both its dimensions:
running sequences, and the step's token budget in the same proportion.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from kvfleet.compute_service.engine.sequence import Sequence, Status
from kvfleet.compute_service.kv.cache_manager import KVCacheManager
from kvfleet.core.allocator import Refusal

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048   # per step; longer prompts are prefilled in chunks
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0  # > 0: longer prompts' chunks yield to shorter ones (vLLM's name)
    step_rows: Callable[[int], int] | None = None  # rows the model computes for a step of N tokens (None: N)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 1:
            raise ValueError(f"scheduler limits must be positive: {self}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}")


@dataclass(slots=True)
class ScheduledBatch:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, tokens this step), > 1
    decodes: list[Sequence] = field(default_factory=list)               # one token each
    preempted: list[Sequence] = field(default_factory=list)
    refused: list[tuple[Sequence, Refusal]] = field(default_factory=list)  # can never be served

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)


def _held_elsewhere(seq: Sequence, refusal: Refusal) -> bool:
    """Whether the blocks that ``refusal`` lacks are held by sequences this scheduler does not run
    (a remote allocator's early allocations of requests still arriving, releases not yet applied)
    and ``seq`` would fit without them: those blocks come back, so ``seq`` waits instead of being
    refused. ``blocks_charged`` counts the tenant's blocks (quota) or the pool's used blocks (pool),
    ``seq``'s own table included::

        refused for good:  own + asked > allowed,  or nothing charged beyond its own table
    """
    own = len(seq.block_table) - seq.num_dropped_blocks
    return own + refusal.blocks_asked <= refusal.blocks_allowed and refusal.blocks_charged > own


def _prompt_tokens(scheduled: list[tuple[Sequence, int]]) -> int:
    """Prompt tokens (chunks of more than one token) in a step's list so far."""
    return sum(n for _, n in scheduled if n > 1)


def _rank(seq: Sequence) -> tuple[int, int]:
    """Sort key: higher priority first, then older first."""
    return (-seq.priority, seq.arrival)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_swapped = 0  # of those, swapped out to the host tier instead of recomputed
        self.num_seqs_cap = config.max_num_seqs  # live cap on admission (the P99 controller's), <= max
        self.step_token_budget = config.max_num_batched_tokens  # follows the live cap in proportion
        self.budget_used_up = False  # the last step's tokens filled its budget

    def set_num_seqs_cap(self, cap: int) -> None:
        """Admit no sequence while ``cap`` run, and give each step ``cap / max_num_seqs`` of the
        configured token budget (rounded up). Running sequences above a lowered cap are not
        preempted (their work would be lost): they finish, and admission waits until fewer run.

        Why the budget follows: a step takes as long as its tokens take, and the slow steps that set
        the p99 inter-token latency are those that prefill the prompts of several admissions at once.
        A cap on sequences alone leaves every step free to take a whole burst of prompts (up to the
        full budget), so the tail falls only with a cap cut far below the batch the target allows,
        and the throughput goes with it. At the maximum the budget is the configured one: a
        controller at its maximum runs the engine exactly as without it."""
        if not 1 <= cap <= self.config.max_num_seqs:
            raise ValueError(f"live cap must be in [1, {self.config.max_num_seqs}], got {cap}")
        self.num_seqs_cap = cap
        self.step_token_budget = math.ceil(self.config.max_num_batched_tokens * cap / self.config.max_num_seqs)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        # a batch still draining above a lowered cap keeps every decode token: only prompts wait
        budget = max(self.step_token_budget, min(len(self.running), self.config.max_num_batched_tokens))
        self.running.sort(key=_rank)
        plan: list[tuple[Sequence, int]] = []
        long_prompts: list[Sequence] = []  # their chunks come after the short prompts (_long_chunks)
        deferred: list[Sequence] = []  # short prompts that wait for the next step (_fits)
        for seq in self.running:
            if budget == 0:
                break
            if self._is_long_prompt(seq):
                long_prompts.append(seq)
                continue
            n = self._chunk(seq, budget)
            if not self._fits(n, _prompt_tokens(plan)):
                deferred.append(seq)  # waits for the next step, holding its blocks
                continue
            plan.append((seq, n))
            budget -= n
        scheduled = self._grow(plan, batch)
        left_by_running = budget
        if not batch.preempted:
            # the long ones step too, after admission; the deferred ones next step: a prompt sharing their
            # uncomputed prefix waits for it rather than compute it beside them
            stepping = [s for s, _ in scheduled] + long_prompts + deferred
            admitted, admitted_long = self._admit(budget, batch, stepping, _prompt_tokens(scheduled))
            budget -= sum(n for _, n in admitted)
            scheduled += admitted
            long_prompts += admitted_long
        if long_prompts:
            scheduled += self._grow(self._long_chunks(long_prompts, budget, _prompt_tokens(scheduled)), batch)
            scheduled = [(s, n) for s, n in scheduled if s.status is Status.RUNNING]  # minus victims
        scheduled = self._fit_rows(scheduled)
        for seq, n in scheduled:
            if n == 1:
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, n))
        self.budget_used_up = batch.num_tokens >= left_by_running
        return batch

    def _is_long_prompt(self, seq: Sequence) -> bool:
        """A prompt with more than ``long_prefill_token_threshold`` tokens still to compute."""
        cap = self.config.long_prefill_token_threshold
        return cap > 0 and seq.num_tokens - seq.num_computed > cap

    def _chunk(self, seq: Sequence, budget: int, prompt_tokens_in_step: int = 0) -> int:
        """The tokens ``seq`` computes this step: what it has left, within the budget. A long prompt
        (``_is_long_prompt``) takes the threshold when the step has no other prompt tokens, else one
        block: it keeps moving, and the short prompts beside it get their first token from as small
        a step as they can."""
        n = min(seq.num_tokens - seq.num_computed, budget)
        if not self._is_long_prompt(seq):
            return n
        share = self.config.long_prefill_token_threshold if prompt_tokens_in_step == 0 else 0
        return min(n, max(share, self.kv.block_size))

    def _fits(self, n: int, prompt_tokens_in_step: int) -> bool:
        """Whether a short prompt's ``n`` tokens join a step that already has ``prompt_tokens_in_step``:
        the first always; more while the step's prompt tokens stay within the threshold. A prefill
        step costs in proportion to its tokens, so two prompts computed one after the other give the
        first its token sooner and the second no later than computed together."""
        cap = self.config.long_prefill_token_threshold
        return n <= 1 or cap == 0 or prompt_tokens_in_step == 0 or prompt_tokens_in_step + n <= cap

    def _fit_rows(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Trim a long prompt's chunk (the last one that keeps at least a block) so that the step's
        tokens are a row count the model computes as it is (``step_rows``). Only shrinks: the blocks
        of the tokens left out stay allocated for the next step."""
        rows_of = self.config.step_rows
        total = sum(n for _, n in scheduled)
        if rows_of is None or total == 0 or rows_of(total) == total:
            return scheduled
        exact = total - 1
        while exact > 0 and rows_of(exact) != exact:
            exact -= 1
        cut = total - exact
        for i in reversed(range(len(scheduled))):
            seq, n = scheduled[i]
            if n > 1 and self._is_long_prompt(seq) and n - cut >= self.kv.block_size:
                scheduled[i] = (seq, n - cut)
                break
        return scheduled

    def _long_chunks(self, seqs: list[Sequence], budget: int, prompt_tokens: int) -> list[tuple[Sequence, int]]:
        """The running long prompts' chunks, once the step's short prompts and decodes are in."""
        plan = []
        for seq in seqs:
            if budget == 0:
                break
            n = self._chunk(seq, budget, prompt_tokens)
            plan.append((seq, n))
            budget -= n
            prompt_tokens += n
        return plan

    def _grow(self, plan: list[tuple[Sequence, int]], batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
        """Blocks for the running sequences' next tokens; preempt to make room where refused."""
        refusals = self.kv.grow(plan)
        granted: list[tuple[Sequence, int]] = []
        for (seq, n), refusal in zip(plan, refusals):
            while refusal is not None and not refusal.transient and seq.status is Status.RUNNING:
                victim = max(self.running, key=_rank)
                if victim is seq and len(self.running) == 1:
                    if _held_elsewhere(seq, refusal):  # step back until those blocks come back
                        self._preempt(seq, batch)
                    else:  # alone and still too big: it can never be served by this pool
                        self._finish_refused(seq, refusal, batch)
                    break
                self._preempt(victim, batch)
                granted = [(s, k) for s, k in granted if s is not victim]
                if victim is not seq:
                    refusal = self.kv.grow([(seq, n)])[0]
            if refusal is None and seq.status is Status.RUNNING:
                granted.append((seq, n))
        return granted

    def _admit(self, budget: int, batch: ScheduledBatch, stepping: list[Sequence],
               prompt_tokens: int = 0) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        """Waiting sequences by rank while budget, seats and blocks last. A full pool stops
        admission (the head of the queue waits for blocks); a tenant over its quota only holds
        back that tenant's requests, and one that could never fit its quota is refused; one whose
        prefix a sequence of this step (``stepping``, then those admitted) is prefilling waits.
        Returns the admitted short prompts with their chunks, and the admitted long ones (their
        chunks come last: ``_long_chunks``). A short one that does not fit the step (``_fits``) is
        admitted and computes from the next step on."""
        admitted: list[tuple[Sequence, int]] = []
        admitted_long: list[Sequence] = []
        self.waiting.sort(key=_rank)
        held_back: list[Sequence] = []
        stepping = list(stepping)
        while self.waiting and budget > 0 and len(self.running) < self.num_seqs_cap:
            seq = self.waiting.pop(0)
            if self.kv.prefix_in_flight(seq, stepping):
                held_back.append(seq)
                continue
            refusal = self.kv.allocate(seq)
            if refusal is not None and refusal.transient:
                self.waiting.insert(0, seq)
                break  # block_service unreachable: ask again next step
            if refusal is not None:
                peers = self.running if refusal.reason == "pool" else [s for s in self.running if s.tenant == seq.tenant]
                if not peers and not _held_elsewhere(seq, refusal):
                    self._finish_refused(seq, refusal, batch)  # it cannot fit even alone
                    continue
                if refusal.reason == "quota":
                    held_back.append(seq)
                    continue
                self.waiting.insert(0, seq)
                break  # pool full: wait for running sequences to free blocks
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            stepping.append(seq)  # computing this step, or next: in flight either way
            if self._is_long_prompt(seq):
                admitted_long.append(seq)
                continue
            n = self._chunk(seq, budget)
            if not self._fits(n, prompt_tokens):
                continue
            admitted.append((seq, n))
            budget -= n
            prompt_tokens += n if n > 1 else 0
        self.waiting[:0] = held_back
        return admitted, admitted_long

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        swapped = self.kv.preempt(seq)  # swapped out (lower tiers, by cost) or to be recomputed
        seq.reset_for_recompute()
        self.waiting.append(seq)
        self.num_preemptions += 1
        self.num_swapped += swapped
        batch.preempted.append(seq)
        log.debug("preempted %s (priority %d, %d tokens, %s)", seq.seq_id, seq.priority, seq.num_tokens,
                  "swapped out" if swapped else "to recompute")

    def _finish_refused(self, seq: Sequence, refusal: Refusal, batch: ScheduledBatch) -> None:
        log.warning("request %s cannot be served: %s", seq.seq_id, refusal.message())
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release([seq])
        seq.status = Status.FINISHED
        seq.finish_reason = "abort"
        batch.refused.append((seq, refusal))

    def finish(self, seqs: list[Sequence]) -> None:
        """Drop finished or aborted sequences and free their blocks."""
        for seq in seqs:
            if seq in self.running:
                self.running.remove(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
            seq.status = Status.FINISHED
        self.kv.release([s for s in seqs if s.block_table])
        self.kv.forget(seqs)
