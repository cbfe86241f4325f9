"""Where a request's time to first token goes on the node, per request (vLLM's queue and prefill
times): **queue** from its arrival at the node (the router's start command) to the first step that
computes any of its prompt, early block allocation and the wait for the step in progress included;
**prefill** from that step to the step that samples its first token. A preempted request keeps its
first times; a request resumed from a failed node is timed here as new. Pure: clocks are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.core.latency_histogram import HistogramSnapshot, LatencyHistogram


class RequestPhases:
    def __init__(self) -> None:
        self.queue = LatencyHistogram()
        self.prefill = LatencyHistogram()

    def scheduled(self, seqs: Iterable[Sequence], now: float) -> None:
        """The sequences of a step about to run."""
        for seq in seqs:
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now

    def first_token(self, seq: Sequence, now: float) -> None:
        """``seq`` sampled its first token on this node at ``now`` (call once per sequence)."""
        scheduled = seq.first_scheduled_s if seq.first_scheduled_s is not None else now
        self.queue.observe(scheduled - seq.arrival_s)
        self.prefill.observe(now - scheduled)

    def snapshots(self) -> tuple[HistogramSnapshot, HistogramSnapshot]:
        return self.queue.snapshot(), self.prefill.snapshot()
