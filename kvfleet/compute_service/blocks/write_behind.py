"""A node's write-behind queue to block_service: top-ups, commits, drops and releases wait here
until one ``ApplyMany`` takes them all, and the queue says when that is due. Pure.

    commit / drop / topup / release ──▶ queued ──take──▶ one batch ──(not taken)── requeue ─┐
                                          ▲                                              │
                                          └──── ahead of what was queued since ◀─────────┘

What another party waits for is urgent and goes at the end of its step: a release (free blocks, the
tenant's quota) and a prompt block's commit (a request sharing the prefix may arrive any moment).
The rest waits for company up to a deadline counted in ``end_step`` calls (``due_within``): a top-up
early enough that its answer is back before its sequence could need the block (the policy counts
the measured round trip in; a deadline already past means the end of this step), a generated
block's commit or a sliding window's drop after at most the policy's ``defer_steps``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class Bookkeeping:
    """One ``ApplyMany``, applied in this order: top-ups (they bring block_service's length of a
    sequence up to the blocks the engine fills, so the commits after them are of full blocks),
    commits (a block is committed by its live sequence), drops (after the commits: a dropped
    block is cached under its hash), releases."""

    topups: list[tuple[str, int]] = field(default_factory=list)       # (seq, tokens to extend to)
    commits: list[tuple[str, int, bytes]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    drops: list[tuple[str, int]] = field(default_factory=list)        # (seq, leading blocks dropped)

    def __bool__(self) -> bool:
        return bool(self.topups or self.commits or self.releases or self.drops)

    def seq_ids(self) -> list[str]:
        """Every sequence the batch touches (the requests its trace links to)."""
        return [s[0] for s in (*self.topups, *self.commits, *self.drops)] + self.releases


class WriteBehind:
    def __init__(self) -> None:
        self._topups: dict[str, int] = {}    # seq → tokens to extend to (the latest ask replaces)
        self._commits: list[tuple[str, int, bytes]] = []
        self._releases: list[str] = []
        self._drops: dict[str, int] = {}     # seq → leading blocks dropped (the latest count)
        self._step = 0                       # end_step calls so far
        self._urgent = False                 # a release or a prompt block's commit is queued
        self._due: int | None = None         # the step by which deferred bookkeeping must go

    def __bool__(self) -> bool:
        return bool(self._commits or self._releases or self._topups or self._drops)

    def topup(self, seq_id: str, num_tokens: int, due_within: int) -> None:
        self._topups[seq_id] = num_tokens
        self._defer(due_within)

    def commit(self, commits: Sequence[tuple[str, int, bytes]], urgent: bool, due_within: int) -> None:
        self._commits.extend(commits)
        if urgent:
            self._urgent = True
        else:
            self._defer(due_within)

    def drop(self, seq_id: str, num_blocks: int, due_within: int) -> None:
        self._drops[seq_id] = max(num_blocks, self._drops.get(seq_id, 0))
        self._defer(due_within)

    def release(self, seq_id: str) -> None:
        """Urgent; the sequence's queued top-up and drop are moot (the release gives back its whole table)."""
        self._topups.pop(seq_id, None)
        self._drops.pop(seq_id, None)
        self._releases.append(seq_id)
        self._urgent = True

    def end_step(self) -> bool:
        """True when what is queued is urgent or due."""
        self._step += 1
        return self._urgent or (self._due is not None and self._step >= self._due)

    def take(self) -> Bookkeeping:
        """Everything queued, to send now in one call."""
        self._urgent, self._due = False, None
        released = set(self._releases)
        batch = Bookkeeping([(s, n) for s, n in self._topups.items() if s not in released],
                            self._commits, self._releases, list(self._drops.items()))
        self._topups, self._commits, self._releases, self._drops = {}, [], [], {}
        return batch

    def requeue(self, batch: Bookkeeping, live: Collection[str]) -> None:
        """A taken batch did not reach block_service: put it back before what was queued since
        (top-ups and drops only of sequences still ``live``); urgent, for the sync to sort out."""
        topups = {s: n for s, n in batch.topups if s in live}
        topups.update(self._topups)  # a newer top-up of a sequence replaces the older one
        self._topups = topups
        self._commits = list(batch.commits) + self._commits
        self._releases = list(batch.releases) + self._releases
        drops = {s: n for s, n in batch.drops if s in live}
        for s, n in self._drops.items():
            drops[s] = max(n, drops.get(s, 0))
        self._drops = drops
        self._urgent = True

    def _defer(self, steps: int) -> None:
        """What was just queued must be sent within ``steps`` more steps."""
        due = self._step + max(steps, 0) + 1  # end_step counts this step first
        self._due = due if self._due is None else min(self._due, due)
