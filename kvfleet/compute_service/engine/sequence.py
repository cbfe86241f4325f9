"""One request's tokens and where its KV lives. Pure Python: no torch.

    tokens:        [ prompt ............ | generated ... ]
    num_computed:  tokens whose K/V is written in the pool (the next step starts there)
    num_allocated_tokens: tokens the page table has room for (a whole prompt is reserved at once)
    block_table:   block ids holding positions [0, len(block_table) * block_size)
    num_dropped_blocks: leading entries of block_table given back (sliding window: outside every
                   layer's window); the entries stay, stale, and no kernel reads them
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from kvfleet.core.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_arrival = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    tenant: str = "default"
    priority: int = 0                  # higher is served first and preempted last
    prefix_group: str = ""             # salts its chain instead of the tenant (kvfleet.core.block_hash.tenant_extra_key)
    arrival: int = field(default_factory=lambda: next(_arrival))
    arrival_s: float = field(default_factory=time.monotonic)  # reached the node (request_phases.py)
    first_scheduled_s: float | None = None                     # its first step began
    token_ids: list[int] = field(init=False)
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_allocated_tokens: int = 0      # tokens the page table holds room for (>= num_computed)
    block_hashes: list[bytes] = field(default_factory=list)   # of full blocks, chained
    num_committed_blocks: int = 0
    num_dropped_blocks: int = 0        # leading blocks given back (sliding window)
    num_cached_tokens: int = 0         # prefix-cache hit at first admission (reported in usage)
    num_preemptions: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def reset_for_recompute(self) -> None:
        """After preemption: the KV is gone, the tokens (generated ones too) are kept."""
        self.status = Status.WAITING
        self.num_computed = 0
        self.block_table = []
        self.num_allocated_tokens = 0
        self.num_committed_blocks = 0
        self.num_dropped_blocks = 0
        self.num_preemptions += 1
