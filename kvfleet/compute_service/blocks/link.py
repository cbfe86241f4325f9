"""How a compute node's link to block_service stands, and what an error on it means. Pure.

    up ──block_service unreachable (UNAVAILABLE, DEADLINE_EXCEEDED, refused)──▶ down ─┐
    up ──NOT_FOUND for this node or one of its live sequences────────────────▶ lost ─┤
    up ◀──────────────── a SyncNode with the node's live sequences succeeded ────────┘

Away from ``up``, the remote allocator answers the engine's calls that need block_service with a
transient refusal, keeps its write-behind bookkeeping queued, and one background task retries the
sync with backoff. Any other error is a bug of one call, not of the link: it is raised (a step
fails its requests) or logged, and the link stays as it was.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet.core.errors import NotFound, Unavailable

UP, DOWN, LOST = "up", "down", "lost"

UNREACHABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


def trouble_of(error: BaseException) -> str | None:
    """``DOWN`` (block_service unreachable or not answering in time), ``LOST`` (it answers but does
    not know this node or a live sequence of it: it restarted without them, or the router dropped
    the pool after the node's lease expired), or None (not the link's trouble)."""
    if isinstance(error, NotFound):
        return LOST
    if isinstance(error, (Unavailable, TimeoutError, ConnectionError)):
        return DOWN
    code = getattr(error, "code", None)  # grpc.aio.AioRpcError: a transport failure
    if callable(code) and getattr(code(), "name", None) in UNREACHABLE_CODES:
        return DOWN
    return None


@dataclass(slots=True)
class BlockLink:
    state: str = UP
    since: float = 0.0          # when it left ``up`` (monotonic seconds)
    num_outages: int = 0        # times it left ``up``
    num_reconciled: int = 0     # sequences block_service held that the node no longer had, released by a sync

    @property
    def up(self) -> bool:
        return self.state == UP

    def lose(self, trouble: str, now: float) -> bool:
        """Record trouble; True when this is news (the link was up: say so, start a resync).
        Unreachable wins over lost: the sync must wait for block_service either way."""
        if trouble not in (DOWN, LOST):
            raise ValueError(f"unknown link trouble {trouble!r}")
        was_up = self.up
        if was_up:
            self.since, self.num_outages = now, self.num_outages + 1
        if was_up or trouble == DOWN:
            self.state = trouble
        return was_up

    def synced(self, now: float) -> float:
        """block_service took the node's sync: the link is up; returns how long it was not."""
        away = 0.0 if self.up else now - self.since
        self.state = UP
        return away
