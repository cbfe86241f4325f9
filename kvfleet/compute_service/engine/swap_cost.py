"""Swap or recompute a preempted sequence, by cost. Pure Python: no torch.

A preempted sequence's KV can be copied out to the host tier and back when it is rescheduled
(swap), or dropped and prefilled again (recompute). Both costs are measured on the machine at
engine start (``kv_tier_store.measure``): the copy bandwidth pool -> host and host -> pool, and
the prefill throughput of a short warm-up forward. Swap wins when

    bytes / out_bytes_per_s + bytes / in_bytes_per_s  <  tokens / prefill_tokens_per_s

A long context on a small model favours swap only when copies are fast; a big model (costly
tokens, same bytes per token or fewer) favours swap sooner.
"""

from __future__ import annotations

from dataclasses import dataclass

PREEMPTION_MODES = ("auto", "swap", "recompute")


def parse_preemption_mode(value: str) -> str:
    if value not in PREEMPTION_MODES:
        raise ValueError(f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)}, got {value!r}")
    return value


@dataclass(slots=True, frozen=True)
class SwapCost:
    out_bytes_per_s: float       # pool -> host
    in_bytes_per_s: float        # host -> pool
    prefill_tokens_per_s: float

    def __post_init__(self) -> None:
        if min(self.out_bytes_per_s, self.in_bytes_per_s, self.prefill_tokens_per_s) <= 0:
            raise ValueError(f"swap cost rates must be positive: {self}")

    def swap_seconds(self, num_bytes: int) -> float:
        return num_bytes / self.out_bytes_per_s + num_bytes / self.in_bytes_per_s

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s


def should_swap(mode: str, cost: SwapCost | None, num_bytes: int, num_tokens: int, has_room: bool) -> bool:
    """Whether to swap a victim holding ``num_bytes`` of KV for ``num_tokens`` computed tokens.
    Never without room in the host tier (swap then falls back to recompute) or nothing computed."""
    if not has_room or num_tokens == 0 or mode == "recompute":
        return False
    if mode == "swap":
        return True
    return cost is not None and cost.swap_seconds(num_bytes) < cost.recompute_seconds(num_tokens)
