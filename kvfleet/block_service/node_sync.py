"""A node's own account of its pool and live sequences, and the plan that makes block_service's view
of that node equal to it (``PageTable.sync_node``, RPC ``SyncNode``).

The node is the truth for its pool: it holds the KV. It sends its pool shape and every live
sequence (id, tenant, block table, length) after block_service restarted or lost its registration,
and every ~30 s to reconcile, so a leak of any origin is bounded in time. Per sequence::

    block_service's view            the node lists it        the node does not list it
    unknown                         adopt (if valid)         -
    live on this node, same table   keep                     release (reconciled)
    live on this node, other table  update (if valid)        release (reconciled)
    live on another node            refuse                   -

A listed sequence is refused when its fields cannot be true (a bad id, a block id outside the pool,
a block twice in one table, a table that does not fit its length, an id listed twice, an id live on
another node); a refused sequence block_service already had on this node is kept as it was. After the
unlisted sequences are released, every block still used on the node is held by a sequence the node
listed, so listed sequences may share blocks (the node shares committed prefix blocks): nothing the
node holds is refused for being held. Adopted blocks are charged even above a quota (the node already
holds them; the ledger keeps the excess as grace, as for a quota cut).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvfleet.block_service.validation import validate_tokens
from kvfleet.core.allocator import DROPPED, LiveSequence
from kvfleet.core.errors import InvalidArgument
from kvfleet.core.ids import check_id


@dataclass(slots=True)
class SyncResult:
    """What ``sync_node`` changed. ``listed`` is the node's list as block_service took it (refused
    sequences left out, or as block_service had them): replaying ``sync_node`` with it on the same
    state gives the same state, so it is what the log records."""

    registered: bool = False                  # the pool was new (or re-registered with a new shape)
    released: list[str] = field(default_factory=list)   # live here, not listed: released
    adopted: list[str] = field(default_factory=list)    # unknown, listed: taken from the node
    updated: list[str] = field(default_factory=list)    # known with another table: the node's taken
    refused: list[tuple[str, str]] = field(default_factory=list)  # (seq_id, why)
    listed: list[LiveSequence] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.registered or self.released or self.adopted or self.updated)


@dataclass(slots=True)
class SyncPlan:
    release: list[str] = field(default_factory=list)
    take: list[LiveSequence] = field(default_factory=list)   # adopt or update, in the node's order
    refused: list[tuple[str, str]] = field(default_factory=list)
    listed: list[LiveSequence] = field(default_factory=list)  # ``SyncResult.listed``


def why_invalid(s: LiveSequence, num_blocks: int, block_size: int) -> str | None:
    """Why the node's account of one sequence cannot be true of a pool of this shape, or None."""
    try:
        check_id("seq_id", s.seq_id)
        check_id("tenant", s.tenant)
        n = validate_tokens(s.num_tokens)
    except InvalidArgument as err:
        return str(err)
    if len(s.block_ids) != -(-n // block_size):
        return f"{len(s.block_ids)} blocks cannot hold {n} tokens in blocks of {block_size}"
    dropped = next((i for i, b in enumerate(s.block_ids) if b != DROPPED), len(s.block_ids))
    held = s.block_ids[dropped:]  # the entries given back (drop_front) lead the table
    bad = [b for b in held if not isinstance(b, int) or not 0 <= b < num_blocks]
    if bad:
        return f"block ids {bad[:5]} are outside the pool of {num_blocks} blocks"
    if dropped * block_size > n:
        return f"{dropped} dropped blocks are more than its {n} tokens fill"
    if len(set(held)) != len(held):
        return "a block appears twice in its table"
    return None


def plan_sync(
    node_id: str,
    num_blocks: int,
    block_size: int,
    listed: Sequence[LiveSequence],
    on_node: Iterable[str],
    known: Callable[[str], tuple[str, LiveSequence] | None],
) -> SyncPlan:
    """What to release, take and refuse. ``on_node``: the ids block_service has live on this node;
    ``known(seq_id)``: ``(node_id, sequence)`` as block_service has it, or None."""
    plan = SyncPlan()
    seen: set[str] = set()  # ids the node's list settles: taken, or kept as they are
    for s in listed:
        why = why_invalid(s, num_blocks, block_size)
        if why is None and s.seq_id in seen:
            why = "listed twice"
        had = known(s.seq_id) if isinstance(s.seq_id, str) else None
        if why is None and had is not None and had[0] != node_id:
            why = f"live on node {had[0]!r}"
        if why is not None:
            plan.refused.append((s.seq_id, why))
            if had is not None and had[0] == node_id and s.seq_id not in seen:
                seen.add(s.seq_id)  # the node holds it: keep it as it was
                plan.listed.append(had[1])
            continue
        seen.add(s.seq_id)
        plan.listed.append(s)
        if had is None or had[1] != s:
            plan.take.append(s)
    plan.release = [s for s in on_node if s not in seen]
    return plan
