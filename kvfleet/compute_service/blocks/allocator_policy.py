"""What a compute node tells block_service about its blocks, and when. Pure: plain lists and dicts.

``RemoteBlockAllocator`` (remote_allocator.py) is the bridge: it moves work between the engine's
step thread and the event loop and calls block_service. What it answers from the node's own
tables, what it sends now, what it defers and what each answer changes is decided here, so it can
be tested without a thread, a loop or a network. The bridge calls it under one lock.

Three rules keep the engine's step from waiting on the network:

- **Ask early.** A request's first allocation is asked for when the request reaches the node
  (``ask``, batched with the other arrivals of a loop iteration), so when the scheduler admits it
  the answer is already here (``allocate``). A mismatch (the engine hashed differently, or
  re-allocates after a preemption) falls back to asking then. An early grant never keeps the
  sequence being admitted waiting: when the pool refuses that one, the newest grants give way
  (``give_back_early``), since their requests are queued behind it.
- **Write-behind.** Commits, drops, releases and reserve top-ups answer nothing the engine needs now:
  they are queued and sent together after a step. What others wait for goes at the end of its
  step: releases (free blocks, the tenant's quota) and commits of prompt blocks (a request
  sharing the prefix may arrive any moment). Decode-time bookkeeping rides along with those, or
  goes on its own once it is due: a top-up early enough that its answer is back before its
  sequence could need the block (``TOPUP_MARGIN`` steps, plus the steps of two measured
  round trips to block_service: ``set_topup_lead``, topup_lead.py; at the latest with the step
  that queued it, and once: not again while it is in flight), a generated block's commit or a
  sliding window's drop after at most ``defer_steps``.
- **One block ahead.** Every sequence holds one block more than the engine has been handed.
  The first allocation asks for it (first_reserve.py: refused for the reserve alone, the blocks
  alone are asked again and a top-up brings it). When the engine crosses a block boundary,
  ``extend`` hands over the reserve at once and queues a top-up; block_service is only on the
  path when no reserve covers the growth. A top-up can go no earlier than that hand-over, so
  where the margin and the lead are more steps than a block's decoding (a slow link, fast steps)
  the top-ups keep that many blocks ahead (``reserve_blocks``, at most ``MAX_RESERVE_BLOCKS``).

The reserve, charged to its tenant like any other block, is none past ``max_model_len``
(``cap_length``: a contiguous layout's reservation already covers it) or for a chain whose every
block is named (an import: it never grows). block_service therefore sees a sequence's length at
block granularity (up to the reserve's end), not token by token: its fill-level figures count a
reserve block as full.

A sequence's blocks, as the node sees them (the early asks carry the reserve from ``take_asks`` on):

    asked ──take_asks──▶ in flight ──fold_asks──▶ early ──allocate──▶ claimed ──release──▶ gone
                                                                        ▲
                                               claim (the engine asked itself, no early) ┘

A request may end at any of these moments, and its release must leave block_service holding
nothing for it: queued, its ask is dropped (never sent); in flight, it is marked and its grant
given back when the answer lands; early, the grant is given back; claimed, the table is the
engine's, which releases it itself (``release``; a request's stream ending calls
``release_unclaimed``, which leaves claimed tables alone).

A claimed table is ``block_ids``: ``block_ids[:handed]`` were handed to the engine, the rest is
the reserve, one block ahead; entries the engine dropped (``drop_front``, a sliding window) are
``DROPPED`` at once, so a sync lists the table as block_service will hold it after the drop.
``num_tokens`` is the sequence's length at block_service (what was asked and granted: the reserve's end
when the first allocation carried it).
Early allocations are kept by ``EarlyGrants`` (early_grants.py); bookkeeping waits in
``WriteBehind`` (write_behind.py) until ``take`` empties it into one ``ApplyMany``; ``end_step``
says when that is due.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfleet.compute_service.blocks.early_grants import EarlyGrants
from kvfleet.compute_service.blocks.first_reserve import FirstReserve
from kvfleet.compute_service.blocks.topup_lead import reserve_blocks
from kvfleet.compute_service.blocks.write_behind import Bookkeeping, WriteBehind
from kvfleet.core.allocator import DROPPED, AllocateRequest, Allocation, LiveSequence, Refusal

if TYPE_CHECKING:
    from kvfleet.block_service.bookkeeping import ApplyResult, ItemError

__all__ = ["DEFER_STEPS", "TOPUP_MARGIN", "AllocatorPolicy", "Bookkeeping", "Growth", "LiveSequence"]

DEFER_STEPS = 16   # the most steps a generated block's commit waits for company
TOPUP_MARGIN = 2   # a top-up goes this many steps (plus the measured lead) before its sequence could need the block


@dataclass(slots=True)
class Growth:
    """``extend``'s first pass: what the node's tables answered, and what needs block_service."""

    answers: dict[str, list[int]]
    short: list[tuple[str, int]]  # (seq, tokens) with no reserve left to cover them


@dataclass(slots=True)
class _Table:
    tenant: str
    block_ids: list[int]     # what block_service gave: handed + reserve
    handed: int              # blocks the engine has been given
    num_tokens: int          # the sequence's length at block_service
    prompt_blocks: int       # full blocks of its prompt: their commits are urgent
    topped: int = 0          # tokens a top-up queued or in flight asks for (0: none; asked once)


class AllocatorPolicy:
    def __init__(self, block_size: int, defer_steps: int = DEFER_STEPS):
        self.block_size = block_size
        self.defer_steps = defer_steps
        self._tables: dict[str, _Table] = {}
        self._early = EarlyGrants()
        self._queue = WriteBehind()
        self._growing: dict[str, int] = {}          # the short sequences of the extend under way
        self._refused: dict[str, Refusal] = {}      # and block_service's refusals of them
        self._in_step = False
        self._max_tokens: int | None = None         # no sequence grows past this (max_model_len)
        self.first = FirstReserve(block_size)      # the first allocation's reserve block
        self._topup_lead = 0                        # steps a top-up goes before the margin (the link's pace)
        self._reserve = 1                           # blocks topped up past the handed ones (more: a slow link)

    def cap_length(self, max_model_len: int) -> None:
        """No sequence grows past ``max_model_len`` tokens: no reserve block beyond it."""
        self._max_tokens = self.first.max_tokens = max_model_len

    def set_topup_lead(self, steps: int) -> None:
        """Top-ups queued from now on go ``steps`` earlier than ``TOPUP_MARGIN`` (the bridge's
        measure of its round trip to block_service in engine steps: ``topup_lead.Pace``), and
        bring as many reserve blocks as decoding goes through in that time (``reserve_blocks``)."""
        self._topup_lead = max(steps, 0)
        self._reserve = reserve_blocks(TOPUP_MARGIN + self._topup_lead, self.block_size)

    # -- early allocation -------------------------------------------------------------------------

    def ask(self, request: AllocateRequest) -> bool:
        """Queue a preallocation; True when it is the first queued (the bridge sends them soon,
        together with the other arrivals of its loop iteration)."""
        return self._early.ask(request)

    def take_asks(self) -> list[AllocateRequest]:
        """The preallocations to send now, each with its reserve block (first_reserve.py)."""
        return self.first.with_reserve(self._early.take())

    def fold_asks(self, asks: Sequence[AllocateRequest], results: Sequence[Allocation | Refusal | None]) -> bool:
        """block_service's answers (``None``: the call failed). A grant for a sequence released
        while its ask was in flight is given back at once. True when a release was queued that
        the bridge should send soon."""
        self.first.answered(asks)
        given = self._early.fold(asks, results)
        for seq_id in given:
            self._queue.release(seq_id)
        return bool(given) and not self._in_step

    # -- the engine's calls -----------------------------------------------------------------------

    def allocate(self, seq_id: str, block_hashes: Sequence[bytes], num_tokens: int) -> Allocation | None:
        """The early allocation if it answers the engine's ask (then it is claimed), else None: the
        engine's ask goes to block_service (an early one that does not fit is given back)."""
        grant = self._early.take_grant(seq_id)
        if grant is None:
            return None
        if self._early.fits(grant, block_hashes, (num_tokens, self.first.ask_tokens(block_hashes, num_tokens))):
            return self.claim(seq_id, grant.request.tenant, grant.allocation, num_tokens, grant.request.num_tokens)
        self._queue.release(seq_id)
        return None

    def give_back_early(self, keep: str, refusal: Refusal) -> list[str]:
        """The pool refused ``keep``, the sequence the engine is admitting: other early grants go
        back (releases queued; their sequences ask again when admitted), the newest first, until
        the blocks they hold past their cache hits cover the shortfall (or none is left). Those
        grants belong to requests queued behind ``keep``, which the scheduler admits only after
        it: holding blocks for them would keep it waiting for blocks that only its own admission
        would free, and with nothing running on the node it would wait forever. The older grants
        stay: they protect the prefixes they hit from eviction. Returns the sequences whose
        grants were given back (none: asking again gains nothing)."""
        if refusal.reason != "pool":
            return []
        shortfall = refusal.blocks_asked - (refusal.blocks_allowed - refusal.blocks_charged)
        given = self._early.give_back(keep, shortfall)
        for seq_id in given:
            self._queue.release(seq_id)
        return given

    def claim(self, seq_id: str, tenant: str, result: Allocation, num_tokens: int,
              asked: int | None = None) -> Allocation:
        """The engine now holds ``result``, granted for ``asked`` tokens (default ``num_tokens``):
        the blocks past the ``num_tokens`` it needs are its reserve; without one (or with fewer
        blocks than a slow link needs), queue a top-up. Returns what the engine is handed."""
        handed = min(self._blocks(num_tokens), len(result.block_ids))
        self._tables[seq_id] = _Table(tenant, list(result.block_ids), handed,
                                      num_tokens if asked is None else asked, num_tokens // self.block_size)
        if len(result.block_ids) < handed + self._reserve:  # no reserve, or less than a slow link needs
            self._topup(seq_id, num_tokens)
        if handed == len(result.block_ids):
            return result
        return Allocation(list(result.block_ids[:handed]), min(result.num_cached_blocks, handed))

    def extend(self, growth: Sequence[tuple[str, int]]) -> Growth:
        """Hand over reserve blocks where they cover the growth (queueing the next reserve);
        the rest is ``short``: the bridge asks block_service (``extend_asks``) and hands over."""
        answers: dict[str, list[int]] = {}
        short: list[tuple[str, int]] = []
        for seq_id, num_tokens in growth:
            if self._covers(seq_id, num_tokens):
                answers[seq_id] = self._hand(seq_id, num_tokens)
            else:
                short.append((seq_id, num_tokens))
        return Growth(answers, short)

    def extend_asks(self, short: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
        """What to ask block_service for the short sequences, once the queue before them was sent:
        one block ahead each (a new reserve); ``fold_extend`` says what to ask next.

        Only those the table still does not cover are asked: a top-up sent with that queue may
        have brought the reserve, and block_service's length then is past the growth. Asking for
        less than it holds is an error, not a refusal (a sequence cannot shrink), so every ask
        here is past the table's end and therefore past block_service's length."""
        self._growing, self._refused = dict(short), {}
        return [(s, (self._blocks(n) + 1) * self.block_size) for s, n in short if not self._covers(s, n)]

    def fold_extend(self, asks: Sequence[tuple[str, int]], results: Sequence[list[int] | Refusal]) -> list[tuple[str, int]]:
        """block_service's answers to ``asks``; returns what to ask next: exactly the growth of
        each sequence whose one-block-ahead ask was refused (empty when done)."""
        retry: list[tuple[str, int]] = []
        for (seq_id, tokens), result in zip(asks, results):
            wanted = self._growing[seq_id]
            if isinstance(result, Refusal):
                if tokens > wanted:
                    retry.append((seq_id, wanted))
                self._refused[seq_id] = result
                continue
            self._refused.pop(seq_id, None)
            table = self._tables[seq_id]
            table.block_ids.extend(result)
            table.num_tokens = max(table.num_tokens, tokens)
        return retry

    def hand_over(self) -> dict[str, list[int] | Refusal]:
        """The answers of the extend under way: the new blocks of each short sequence, or why not."""
        answers: dict[str, list[int] | Refusal] = {}
        for seq_id, num_tokens in self._growing.items():
            refusal = self._refused.get(seq_id)
            if refusal is not None:
                answers[seq_id] = refusal
                continue
            answers[seq_id] = self._hand(seq_id, num_tokens)
        self._growing, self._refused = {}, {}
        return answers

    def abandon_extend(self) -> None:
        """The extend under way got no answer (block_service unreachable): nothing is handed over.
        Blocks granted before it broke stay in their tables; the engine's next growth takes them."""
        self._growing, self._refused = {}, {}

    def commit(self, commits: Sequence[tuple[str, int, bytes]]) -> None:
        if not commits:
            return
        self._early.committed(h for _, _, h in commits)
        # a prompt's blocks are urgent: a request sharing the prefix may be on its way
        urgent = any(index < self._prompt_blocks(seq_id, index) for seq_id, index, _ in commits)
        self._queue.commit(commits, urgent, self.defer_steps)

    def drop_front(self, drops: Sequence[tuple[str, int]]) -> None:
        """The engine gave back its sequences' leading blocks (sliding window): the tables mark
        them ``DROPPED`` now, block_service hears it with the next batch (deferred like a
        generated block's commit, which it always follows)."""
        for seq_id, n in drops:
            table = self._tables.get(seq_id)
            if table is None or n <= 0:
                continue
            table.block_ids[:n] = [DROPPED] * n
            self._queue.drop(seq_id, n, self.defer_steps)

    def release(self, seq_ids: Sequence[str]) -> bool:
        """The engine is done with these sequences: give back what block_service holds or will
        hold for them (a claimed table, an early allocation it never claimed, one in flight when
        its answer lands; a queued ask is dropped). A sequence unknown or already released sends
        nothing. True when the bridge should send soon (between steps: after an abort no
        ``end_step`` comes to send it)."""
        queued = False
        for seq_id in seq_ids:
            if self._tables.pop(seq_id, None) is not None or self._early.release(seq_id):
                self._queue.release(seq_id)
                queued = True
        return queued and not self._in_step

    def release_unclaimed(self, seq_ids: Sequence[str]) -> bool:
        """A request's stream ended: give back only what the engine never claimed (as ``release``).
        A claimed table is left alone: the engine may be in a step with it right now, and releases
        it itself when the request's abort reaches it."""
        return self.release([s for s in seq_ids if s not in self._tables])

    # -- steps and sending ------------------------------------------------------------------------

    def begin_step(self) -> None:
        self._in_step = True

    def end_step(self) -> bool:
        """The engine finished a step: True when what is queued is urgent or due."""
        self._in_step = False
        return self._queue.end_step()

    def has_bookkeeping(self) -> bool:
        return bool(self._queue)

    def take(self) -> Bookkeeping:
        """Everything queued, to send now in one call."""
        return self._queue.take()

    def fold_applied(self, batch: Bookkeeping, result: ApplyResult) -> list[ItemError]:
        """block_service's answer to a sent batch; returns its refusals worth a line (a release of
        a sequence already gone is what the release wanted)."""
        self.fold_topups(batch.topups, result.growth)
        self.fold_commits(batch.commits, {e.index for e in result.errors if e.kind == "commit"})
        return [e for e in result.errors if not (e.code == "NOT_FOUND" and e.kind == "release")]

    def fold_topups(self, topups: Sequence[tuple[str, int]], results: Sequence[list[int] | Refusal]) -> None:
        """block_service's answers to sent top-ups: granted blocks join their tables as the reserve."""
        for (seq_id, tokens), new in zip(topups, results):
            table = self._tables.get(seq_id)
            if table is None:
                continue
            if isinstance(new, list):
                table.block_ids.extend(new)
                table.num_tokens = max(table.num_tokens, tokens)
            elif table.topped == tokens:
                table.topped = 0  # refused: the next growth asks again

    def fold_commits(self, commits: Sequence[tuple[str, int, bytes]], refused: Collection[int]) -> None:
        """Sent commits block_service took (all but the indexes ``refused``): a commit declares its
        block full, so block_service's length of the sequence is now at least that block's end
        (it grows past a prompt's length when a refused top-up left it inside the block). Folded
        on the answer, not when queued, so a sync in between lists what block_service holds."""
        for i, (seq_id, index, _) in enumerate(commits):
            table = self._tables.get(seq_id)
            if table is not None and i not in refused:
                table.num_tokens = max(table.num_tokens, (index + 1) * self.block_size)

    def requeue(self, batch: Bookkeeping) -> None:
        """A taken batch did not reach block_service: put it back before what was queued since,
        for the sync to sort out (top-ups of sequences released meanwhile are dropped)."""
        self._queue.requeue(batch, self._tables)

    def take_for_sync(self) -> tuple[Bookkeeping, list[LiveSequence]]:
        """What is queued and the live sequences, at one moment: a sync lists exactly the
        sequences whose releases are not in that batch."""
        return self.take(), self.live_sequences()

    def after_sync(self, batch: Bookkeeping, refused: Sequence[str]) -> Bookkeeping:
        """Of a batch taken for a sync that block_service did not get first, what to send after it:
        its releases are moot (the sync released every sequence not listed) and so are its drops
        (the listed tables have their dropped entries ``DROPPED`` already), its commits and
        top-ups of sequences still live and accepted are not (commits keep prefix hits; top-ups
        bring the reserve). Early allocations block_service refused are forgotten (nothing to
        release there); refused claimed sequences are the engine's to fail and release."""
        self._early.forget(refused)
        gone = set(refused)
        topups = [(s, n) for s, n in batch.topups if s in self._tables and s not in gone]
        held = {s: len(t.block_ids) for s, t in self._tables.items() if s not in gone}
        commits = [c for c in batch.commits if c[0] in held and c[1] < held[c[0]]
                   and self._tables[c[0]].block_ids[c[1]] != DROPPED]
        return Bookkeeping(topups, commits, [])

    def live_sequences(self) -> list[LiveSequence]:
        """What block_service holds for this node as far as the node knows: claimed tables (reserve
        included) and early allocations not yet claimed. A node re-registering sends these."""
        live = [LiveSequence(s, t.tenant, t.block_ids, t.num_tokens) for s, t in self._tables.items()]
        return live + self._early.live()

    # -- internals --------------------------------------------------------------------------------

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _covers(self, seq_id: str, num_tokens: int) -> bool:
        return self._blocks(num_tokens) <= len(self._tables[seq_id].block_ids)

    def _hand(self, seq_id: str, num_tokens: int) -> list[int]:
        """The blocks a sequence growing to ``num_tokens`` gets from its table (covered); when that
        uses up the reserve, queue the next one."""
        table, need = self._tables[seq_id], self._blocks(num_tokens)
        new = table.block_ids[table.handed:need]
        table.handed = max(table.handed, need)
        if len(table.block_ids) < table.handed + self._reserve:
            self._topup(seq_id, num_tokens)
        return new

    def _prompt_blocks(self, seq_id: str, index: int) -> int:
        table = self._tables.get(seq_id)
        return table.prompt_blocks if table is not None else index + 1

    def _topup(self, seq_id: str, num_tokens: int) -> None:
        """Queue the reserve blocks past the handed ones of a sequence now ``num_tokens`` long
        (one; more on a slow link), unless a top-up queued or in flight asks for them already: due
        early enough before decoding (a token a step) fills the blocks it has that its answer is
        back in time (the margin and the measured lead; at the latest with this step)."""
        table = self._tables[seq_id]
        want = table.handed + self._reserve
        if self._max_tokens is not None:  # no block past the one holding the last token it may reach
            want = min(want, max(self._blocks(self._max_tokens), table.handed))
        tokens = want * self.block_size
        if want <= len(table.block_ids) or tokens <= table.topped:
            return
        table.topped = tokens
        free = len(table.block_ids) * self.block_size - num_tokens
        self._queue.topup(seq_id, tokens, free - TOPUP_MARGIN - self._topup_lead)
