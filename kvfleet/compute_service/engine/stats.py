"""The engine's figures at one moment: the one stats object every reader takes as it is (the node's
Prometheus families, the serve session's reports), the way vLLM's ``v1/metrics/stats.py`` is read
by each of its loggers. Pure: the engine fills it (``LLMEngine.stats``), nobody copies it field by
field into another shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfleet.compute_service.kv.tier_index import PrefixLookups, TierCounts
from kvfleet.core.allocator import AllocatorStats
from kvfleet.core.latency_histogram import HistogramSnapshot


@dataclass(slots=True, frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    max_num_seqs_live: int            # the scheduler's live cap on running sequences
    generated_tokens: int
    prompt_tokens_computed: int       # prefilled here (prefix-cache hits are not computed)
    num_preemptions: int
    busy_seconds: float               # spent in model steps
    blocks: AllocatorStats            # the pool's figures (block_service's for a remote pool)
    lookups: PrefixLookups = field(default_factory=PrefixLookups)  # admission lookups: hot, host, disk, miss
    tiers: TierCounts | None = None   # lower tiers' capacity and use (None: no host tier)
    num_swapped: int = 0              # preemptions swapped out instead of recomputed
    num_step_failures: int = 0        # steps that raised (their requests ended with finish reason "error")
    prefill_tokens_per_s: float = 0.0  # measured on mostly-prefill steps, kept current (0: none yet)
    intra_op_threads: int = 0         # torch's thread count now (thread_governor.py); 0 off CPU
    queue_time: HistogramSnapshot | None = None    # per request: arrival → first step (request_phases.py)
    prefill_time: HistogramSnapshot | None = None  # first step → first token
