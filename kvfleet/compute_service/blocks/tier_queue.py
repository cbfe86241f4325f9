"""The remote allocator's side of a node's lower tiers: moves waiting to be sent, the hashes
block_service refused, and where the node's whole lower-tier index is read at a sync.

    engine thread: record_tiers ─▶ queued ─(end_step)─▶ loop: ApplyMany's tier moves ─▶ refused ─▶ take_tier_refusals
    loop, at a sync:  queued moves dropped (moot) ─▶ source() ─▶ SyncNode's lower_tiers (replaces block_service's)

The moves go with the step's other bookkeeping, in the order the node made them, never waited for.
At a sync the node's own index is the truth: the queued moves are dropped before it is read, and a
move made between the two is sent again after the sync, which changes nothing (a move names the
state a block is in, not a difference). Without a source nothing is dropped: the moves follow the
sync as they would have. Thread-safe: its lock is never held while the node's source runs (the
node may hold its own lock when it records a move).

Pure: no grpc, no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from kvfleet.core.allocator import TierChange

TierSource = Callable[[], list[TierChange]]


class TierQueue:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queued: list[TierChange] = []
        self._refused: list[bytes] = []
        self._source: TierSource | None = None

    def record(self, changes: Sequence[TierChange]) -> None:
        with self._lock:
            self._queued += changes

    @property
    def pending(self) -> bool:
        return bool(self._queued)

    def take(self) -> list[TierChange]:
        """Every queued move, to send now."""
        with self._lock:
            taken, self._queued = self._queued, []
        return taken

    def requeue(self, changes: Sequence[TierChange]) -> None:
        """Moves taken but not sent: ahead of those queued since, in their order."""
        with self._lock:
            self._queued[:0] = changes

    def refuse(self, hashes: Sequence[bytes]) -> None:
        """block_service did not record these moves into a lower tier: the node drops the copies."""
        if hashes:
            with self._lock:
                self._refused += hashes

    def fold_applied(self, sent: Sequence[TierChange], result) -> None:
        """block_service's answer (``ApplyResult``) to a batch carrying the moves ``sent``: the
        moves it did not record (past the tenant's cap, or bad) are refused; a move of a sequence
        it lost is not (the node's sync sends its whole index again)."""
        self.refuse(result.tier_refused + [sent[e.index].block_hash for e in result.errors
                                           if e.kind == "tier" and e.code != "NOT_FOUND"])

    def take_refusals(self) -> list[bytes]:
        with self._lock:
            refused, self._refused = self._refused, []
        return refused

    def set_source(self, source: TierSource) -> None:
        self._source = source

    def index_for_sync(self) -> list[TierChange] | None:
        """The node's whole lower-tier index for a sync (its queued moves dropped: moot), or None
        without a source (then the queued moves stay, to follow the sync)."""
        source = self._source
        if source is None:
            return None
        with self._lock:
            self._queued = []
        return list(source())
