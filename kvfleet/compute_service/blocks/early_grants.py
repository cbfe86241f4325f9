"""Early allocations: a request's first blocks, asked for when it reaches the node, held until the
engine claims them. Pure.

    asked ──take──▶ in flight ──fold──▶ granted ──take_grant (it fits)──▶ the engine's table
      │                 │                  │
      release: dropped  release: marked,   release, give_back, or it does not fit:
      (never sent)      given back when    given back (the caller queues the release)
                        its answer lands

An ask is sent (and granted) with the sequence's reserve block (allocator_policy.py), or without
it when block_service refused that; either fits. An ask is answered with the prefix hit
block_service saw when it was sent; ``RecentCommits`` says whether a block the grant missed was
committed on this node since (the grant is stale then: asking again finds it cached instead of
computing it again).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from kvfleet.compute_service.blocks.recent_commits import RecentCommits
from kvfleet.core.allocator import AllocateRequest, Allocation, LiveSequence, Refusal


@dataclass(slots=True, frozen=True)
class Grant:
    request: AllocateRequest
    allocation: Allocation
    mark: int  # ``RecentCommits.mark()`` when the ask was sent: the commits block_service saw


class EarlyGrants:
    def __init__(self) -> None:
        self._asks: list[AllocateRequest] = []             # to send
        self._in_flight: dict[str, tuple[bool, int]] = {}  # sent → (released before its answer, mark)
        self._granted: dict[str, Grant] = {}               # granted, not claimed (in grant order)
        self._recent_commits = RecentCommits()

    def ask(self, request: AllocateRequest) -> bool:
        """Queue an ask; True when it is the first queued (the caller sends them soon, together
        with the other arrivals of its loop iteration)."""
        self._asks.append(request)
        return len(self._asks) == 1

    def take(self) -> list[AllocateRequest]:
        """The asks to send now."""
        asks, self._asks = self._asks, []
        mark = self._recent_commits.mark()  # the commits queued so far are sent before the asks
        self._in_flight.update((r.seq_id, (False, mark)) for r in asks)
        return asks

    def fold(self, asks: Sequence[AllocateRequest], results: Sequence[Allocation | Refusal | None]) -> list[str]:
        """block_service's answers (``None``: the call failed). A grant waits for the engine; a
        refusal is not kept (the engine asks again when it admits the sequence). Returns the
        sequences released while their ask was in flight whose grant came: to give back now."""
        give_back: list[str] = []
        for request, result in zip(asks, results):
            released, mark = self._in_flight.pop(request.seq_id, (False, 0))
            if not isinstance(result, Allocation):
                continue
            if released:
                give_back.append(request.seq_id)
            else:
                self._granted[request.seq_id] = Grant(request, result, mark)
        return give_back

    def committed(self, block_hashes: Iterable[bytes]) -> None:
        """Blocks committed on this node (queued to block_service)."""
        self._recent_commits.record(block_hashes)

    def take_grant(self, seq_id: str) -> Grant | None:
        return self._granted.pop(seq_id, None)

    def fits(self, grant: Grant, block_hashes: Sequence[bytes], asked_as: Collection[int]) -> bool:
        """The grant answers the engine's ask: asked the same way (the same hashes, for one of
        ``asked_as``: the engine's tokens, or those through its reserve block), and not stale (no
        block it missed was committed on this node after it was asked: another sequence
        prefilled the shared prefix meanwhile)."""
        hit = grant.allocation.num_cached_blocks
        stale = hit < len(block_hashes) and self._recent_commits.committed_since(block_hashes[hit], grant.mark)
        return (list(grant.request.block_hashes) == list(block_hashes)
                and grant.request.num_tokens in asked_as and not stale)

    def give_back(self, keep: str, shortfall: int) -> list[str]:
        """The newest grants other than ``keep``'s, until the blocks they hold past their cache
        hits cover ``shortfall`` (or none is left); they are forgotten here, the caller queues their
        releases."""
        given: list[str] = []
        for seq_id in reversed(list(self._granted)):
            if shortfall <= 0:
                break
            if seq_id == keep:
                continue
            grant = self._granted.pop(seq_id)
            shortfall -= len(grant.allocation.block_ids) - grant.allocation.num_cached_blocks
            given.append(seq_id)
        return given

    def release(self, seq_id: str) -> bool:
        """The sequence's request ended before the engine claimed it: True when a grant must be
        given back now; an ask in flight is marked (given back when its answer lands), a queued
        one dropped."""
        if seq_id in self._in_flight:
            self._in_flight[seq_id] = (True, self._in_flight[seq_id][1])
            return False
        if self._granted.pop(seq_id, None) is not None:
            return True
        self._asks = [r for r in self._asks if r.seq_id != seq_id]
        return False

    def forget(self, seq_ids: Iterable[str]) -> None:
        """block_service refused to hold these grants (after a sync): nothing to give back."""
        for seq_id in seq_ids:
            self._granted.pop(seq_id, None)

    def live(self) -> list[LiveSequence]:
        return [LiveSequence(s, g.request.tenant, g.allocation.block_ids, g.request.num_tokens)
                for s, g in self._granted.items()]
