"""The router's admission queue: which waiting request runs next.

    score = w_paid · paid_level / max_paid_level + w_wait · wait / wait_scale_s

The paid term lies in [0, 1]; the wait term grows by one every ``wait_scale_s`` (10 s by default)
and has no ceiling, so every request ends up outranking every newer one: a request that arrived Δ
seconds after r is taken before r only while

    Δ < (w_paid / w_wait) · wait_scale_s · (its paid term − r's paid term)     (15 s at most by default)

Equal paid levels run in arrival order. A wait term bounded by 1 (the wait over the longest wait in
the queue) could never make up a paid gap above w_wait / w_paid (2/3): a free tenant behind a steady
stream of top-paid requests would wait without bound. A tenant at its concurrency limit is skipped,
not blocking others; nothing runs while ``capacity`` requests (all tenants together) are running
(the router sets it from the nodes' live caps as they change). The queue is bounded: when full, the
lowest-scoring request (possibly the newcomer) is shed.

Pure logic: time is passed in, nothing here sleeps or awaits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class QueueWeights:
    paid: float = 0.6
    wait: float = 0.4
    wait_scale_s: float = 10.0  # seconds of waiting worth one unit of the wait term

    def __post_init__(self) -> None:
        if self.paid < 0 or self.wait < 0 or self.paid + self.wait <= 0:
            raise ValueError(f"queue weights must be >= 0 and not both 0, got {self.paid}/{self.wait}")
        if not self.wait_scale_s > 0:
            raise ValueError(f"wait_scale_s must be positive, got {self.wait_scale_s}")


@dataclass(slots=True)
class QueuedRequest:
    request_id: str
    tenant: str
    paid: float          # normalised paid level, in [0, 1]
    enqueued_at: float   # seconds, same clock as the `now` passed to the queue
    payload: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.paid <= 1.0:
            raise ValueError(f"normalised paid level must be in [0, 1], got {self.paid}")


class PriorityQueue:
    def __init__(
        self,
        max_size: int,
        concurrency_limits: Mapping[str, int] | None = None,
        weights: QueueWeights = QueueWeights(),
        capacity: int | None = None,
    ):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self.capacity: int | None = None  # most requests running at once, all tenants together; None: no limit
        self.set_capacity(capacity)
        self.weights = weights
        self._limits = dict(concurrency_limits or {})
        self._queued: dict[str, QueuedRequest] = {}  # insertion order = arrival order
        self._running: dict[str, int] = {}           # tenant -> requests popped and not finished
        self._num_running = 0                        # == sum(self._running.values())

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queued

    def num_running(self, tenant: str | None = None) -> int:
        """Requests running for ``tenant``, or for all tenants."""
        return self._num_running if tenant is None else self._running.get(tenant, 0)

    def waiting(self) -> list[QueuedRequest]:
        """The queued requests in arrival order (a copy: for metrics and reports)."""
        return list(self._queued.values())

    def running_by_tenant(self) -> dict[str, int]:
        """Requests running per tenant (a copy)."""
        return dict(self._running)

    def set_capacity(self, capacity: int | None) -> None:
        """A new limit on requests running at once; those above a lowered one finish, nothing is stopped."""
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be >= 1 or None, got {capacity}")
        self.capacity = capacity

    def score(self, item: QueuedRequest, now: float) -> float:
        wait = max(now - item.enqueued_at, 0.0) / self.weights.wait_scale_s
        return self.weights.paid * item.paid + self.weights.wait * wait

    def push(self, item: QueuedRequest, now: float) -> QueuedRequest | None:
        """Queue ``item``; when the queue is full, return the request shed to make room (which may be
        ``item`` itself: a newcomer never displaces a request that scores at least as high)."""
        if item.request_id in self._queued:
            raise ValueError(f"request {item.request_id!r} is already queued")
        if len(self._queued) < self.max_size:
            self._queued[item.request_id] = item
            return None
        # Newest first, so that among equal scores the newest is shed.
        victim = min([item, *reversed(self._queued.values())], key=lambda q: self.score(q, now))
        if victim is not item:
            del self._queued[victim.request_id]
            self._queued[item.request_id] = item
        return victim

    def remove(self, request_id: str) -> QueuedRequest | None:
        """Take a request out without running it (its caller went away)."""
        return self._queued.pop(request_id, None)

    def _has_slot(self, tenant: str) -> bool:
        limit = self._limits.get(tenant)
        return limit is None or self._running.get(tenant, 0) < limit

    def _full(self) -> bool:
        return self.capacity is not None and self._num_running >= self.capacity

    def can_pop(self) -> bool:
        return not self._full() and any(self._has_slot(q.tenant) for q in self._queued.values())

    def pop(self, now: float) -> QueuedRequest | None:
        """The best-scoring request whose tenant has a free slot, now counted as running; None when
        nothing can run."""
        if self._full():
            return None
        best: QueuedRequest | None = None
        best_score = float("-inf")
        for q in self._queued.values():  # arrival order: the first of equal scores wins
            if not self._has_slot(q.tenant):
                continue
            s = self.score(q, now)
            if s > best_score:
                best, best_score = q, s
        if best is not None:
            del self._queued[best.request_id]
            self._running[best.tenant] = self._running.get(best.tenant, 0) + 1
            self._num_running += 1
        return best

    def finish(self, tenant: str) -> None:
        """A request popped for ``tenant`` is done: its slot is free again."""
        running = self._running.get(tenant, 0)
        assert running > 0, f"finish() for tenant {tenant!r} with nothing running"
        self._num_running -= 1
        if running == 1:
            del self._running[tenant]
        else:
            self._running[tenant] = running - 1
