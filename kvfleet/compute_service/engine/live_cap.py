"""The P99 batch controller at work on a node: token gaps in, the scheduler's live cap out.

    engine step ─▶ outputs ─▶ LiveCap.after_step: gap since each request's previous token
                                   │  (the inter-token latency its client sees, preemptions and
                                   │   other requests' prefill chunks included)
                                   ▼
                         BatchController.observe / decide ─▶ Scheduler.set_num_seqs_cap
                                                              (sequences, and the step's token
                                                               budget in proportion)

It runs on the engine's step thread, after every step (``AsyncEngine``'s ``after_step``), so the
scheduler is only ever touched by that thread. ``cap`` and ``last_decision`` are plain values that
the node's event loop reads for its metrics and its membership record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvfleet.compute_service.engine.batch_controller import BatchController, Decision
from kvfleet.compute_service.engine.request_output import RequestOutput
from kvfleet.compute_service.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class LiveCap:
    def __init__(self, controller: BatchController, scheduler: Scheduler, node_id: str = "local",
                 clock: Callable[[], float] = time.monotonic):
        self.controller = controller
        self.scheduler = scheduler
        self.node_id = node_id
        self.clock = clock
        self.cap = controller.cap
        self.last_decision: Decision | None = None
        self._last_token: dict[str, float] = {}  # request id → when its latest token came out
        scheduler.set_num_seqs_cap(self.cap)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        now = self.clock()
        gaps = []
        for out in outputs:
            if out.new_token_ids:
                last = self._last_token.get(out.request_id)
                if last is not None:  # the first token is time to first token, not ITL
                    gaps.append(now - last)
                self._last_token[out.request_id] = now
            if out.finished:
                self._last_token.pop(out.request_id, None)
        self.controller.observe(now, gaps, len(self.scheduler.running), self.scheduler.budget_used_up)
        if self.controller.due(now):
            self._decide(now)

    def _decide(self, now: float) -> None:
        decision = self.last_decision = self.controller.decide(now)
        # requests aborted between steps never show a last output here: forget them once stale
        stale = now - self.controller.config.window_s
        self._last_token = {rid: t for rid, t in self._last_token.items() if t >= stale}
        if decision.changed:
            self.scheduler.set_num_seqs_cap(decision.cap)
            self.cap = decision.cap
            log.info("node %s: p99 ITL %.1f ms against a target of %.1f ms over %d tokens; running sequences "
                     "capped at %d (was %d)", self.node_id, decision.p99_s * 1e3,
                     self.controller.config.target_s * 1e3, decision.num_samples, decision.cap, decision.old_cap)
