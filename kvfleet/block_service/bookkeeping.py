"""A node's write-behind bookkeeping, applied item by item: growth, commits, drops, releases, tiers.

A compute node sends what its engine did since the last step in one batch (``ApplyMany``):
growth, commits, drops (a sliding-window sequence's blocks outside its window), releases. One item
the page table cannot accept — a commit of a block that is not full, a release of a sequence already
gone — must not cost the others: a rejected batch would lose its releases and leak their blocks
until the node re-registers. So each item is applied on its own; a bad one is refused
alone and reported (``ItemError``: which part, which index, the status code and the message), and
the rest is applied in the same order as a whole batch would be. The applied items are returned
too, so that the log records exactly what changed (``DurablePageTable.apply``).

Last come the node's lower-tier moves (``TierBatch``): each is validated alone, the valid
ones applied in order; a demotion past the tenant's lower-tier cap is an answer, not an error
(``ApplyResult.tier_refused``: the node drops its copy).

Growth goes first because a node commits the reserve block it filled in the same batch as the
top-up that tells block_service the sequence grew into it; commits come before drops and releases
so that a dropped or released block is cached under its hash, not freed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvfleet.block_service.lower_tiers import validate_tier_change
from kvfleet.block_service.page_table import PageTable
from kvfleet.core.allocator import Refusal, TierChange
from kvfleet.core.errors import BlockServiceError, InvalidArgument

GROWTH, COMMIT, DROP, RELEASE, TIER = "growth", "commit", "drop", "release", "tier"


@dataclass(slots=True, frozen=True)
class TierBatch:
    """A node's lower-tier moves in one bookkeeping batch (a move names a hash, not a sequence,
    so the batch names its node)."""

    node_id: str
    changes: Sequence[TierChange]


@dataclass(slots=True, frozen=True)
class ItemError:
    """One item of a bookkeeping batch that was refused; nothing of it was applied.

    ``index`` counts within its part (``kind``): the ``index``-th growth, commit (one per block) or
    release of the batch. ``code`` names the gRPC status the item alone would have been answered with.
    """

    kind: str
    index: int
    seq_id: str
    code: str
    message: str

    def line(self) -> str:
        if self.kind == TIER:  # a move names a block hash, not a sequence
            return f"tier move #{self.index} refused ({self.code}): {self.message}"
        return f"{self.kind} #{self.index} of sequence {self.seq_id!r} refused ({self.code}): {self.message}"


@dataclass(slots=True)
class ApplyResult:
    """The answer to a bookkeeping batch.

    ``growth`` has one entry per growth item, in order: the new block ids, a ``Refusal`` (pool or
    quota full: an answer, the sequence unchanged), or the item's ``ItemError``. ``errors`` lists
    every refused item of all three parts, in the order they were applied.
    """

    num_committed: int = 0
    growth: list[list[int] | Refusal | ItemError] = field(default_factory=list)
    errors: list[ItemError] = field(default_factory=list)
    tier_refused: list[bytes] = field(default_factory=list)  # demotions past the tenant's lower-tier cap


@dataclass(slots=True)
class Applied:
    """The items that changed the page table, per part, for the log."""

    growth: list[tuple[str, int]] = field(default_factory=list)
    commits: list[tuple[str, int, bytes]] = field(default_factory=list)
    drops: list[tuple[str, int]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    tiers: list[TierChange] = field(default_factory=list)


def apply_bookkeeping(
    table: PageTable,
    growth: Sequence[tuple[str, int]],
    commits: Sequence[tuple[str, int, bytes]],
    releases: Sequence[str],
    tenant: str | None = None,
    drops: Sequence[tuple[str, int]] = (),
    tiers: TierBatch | None = None,
) -> tuple[ApplyResult, Applied]:
    """Apply each item on its own; a sequence named twice in the growth or the releases is refused
    the second time (a batch of the page table names a sequence once, and so does its log record)."""
    result, applied = ApplyResult(), Applied()

    def each(kind: str, items: Sequence, seq_of: Callable, call: Callable, unique: bool) -> list:
        seen: set[str] = set()
        answers = []
        for i, item in enumerate(items):
            seq_id = seq_of(item)
            try:
                if unique and seq_id in seen:
                    raise InvalidArgument(f"sequence {seq_id!r} appears twice in the {kind} of one batch")
                answer = call(item)
            except BlockServiceError as err:
                answer = ItemError(kind, i, str(seq_id), err.code, str(err))
                result.errors.append(answer)
            else:
                seen.add(seq_id)
            answers.append(answer)
        return answers

    for item, answer in zip(growth, each(GROWTH, growth, lambda g: g[0],
                                         lambda g: table.extend([g], tenant)[0], unique=True)):
        result.growth.append(answer)
        if type(answer) is list:
            applied.growth.append(item)
    for item, answer in zip(commits, each(COMMIT, commits, lambda c: c[0],
                                          lambda c: table.commit([c], tenant), unique=False)):
        if type(answer) is int:
            result.num_committed += answer
            if answer:
                applied.commits.append(item)
    for item, answer in zip(drops, each(DROP, drops, lambda d: d[0],
                                        lambda d: table.drop_front([d], tenant), unique=True)):
        if not isinstance(answer, ItemError):
            applied.drops.append(item)
    for item, answer in zip(releases, each(RELEASE, releases, lambda s: s,
                                           lambda s: table.release([s], tenant), unique=True)):
        if not isinstance(answer, ItemError):
            applied.releases.append(item)
    if tiers is not None and tiers.changes:
        _apply_tiers(table, tiers, result, applied)
    return result, applied


def _apply_tiers(table: PageTable, tiers: TierBatch, result: ApplyResult, applied: Applied) -> None:
    """Each move validated alone, the valid ones applied in one call; an unknown node refuses
    them all (NOT_FOUND: the node resyncs, and its sync re-sends its whole index)."""
    valid = []
    for i, c in enumerate(tiers.changes):
        try:
            validate_tier_change(c)
        except BlockServiceError as err:
            result.errors.append(ItemError(TIER, i, "", err.code, str(err)))
        else:
            valid.append(c)
    try:
        out = table.record_tiers(tiers.node_id, valid)
    except BlockServiceError as err:
        result.errors.append(ItemError(TIER, 0, "", err.code, f"{len(valid)} tier moves: {err}"))
        return
    result.tier_refused += out.refused
    applied.tiers += out.applied
