"""The node's block accounting against block_service's, under every interleaving the remote
allocator's bridge allows: ``AllocatorPolicy`` driven as ``RemoteBlockAllocator`` drives it, a real
``PageTable`` in process as block_service, and a small model of the engine and the request streams
around them. At quiescence (everything queued sent and answered, no call in flight, the link up)
block_service holds for the node exactly what ``live_sequences()`` lists, every early ask was
answered, and a periodic reconciliation never finds a leak.

How the bridge is played. Everything that runs under its flush lock (a flush, the engine's
synchronous allocate or extend, a sync) is a generator here, queued in lock order; each ``yield``
is an ``await`` of the bridge, where the loop's other callbacks (an arrival's ask, a stream's end)
and the engine thread's calls (which take only the policy lock) may run. An RPC is two yields: the
call leaves (block_service applies it, or not), then its answer comes back (or does not: a
timeout, the link marked down, a resync later). The engine thread waits while its own call is in
the queue; the loop never waits.
"""

from __future__ import annotations

from inspect import GEN_CREATED, getgeneratorstate

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfleet.block_service.bookkeeping import apply_bookkeeping
from kvfleet.block_service.page_table import PageTable
from kvfleet.compute_service.blocks.allocator_policy import AllocatorPolicy, Bookkeeping
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal
from kvfleet.core.allocator import LiveSequence as ListedSequence
from kvfleet.core.errors import AlreadyExists
from kvfleet.core.tenants import Tenant
from tests.compute_service.accounting_world import BPB, BS, FATES, NODE, NUM_BLOCKS, PROMPTS, TENANTS, Lost, Request, block_hash
from tests.examples import examples


class AccountingMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.table = PageTable()
        self.table.register_node(NODE, NUM_BLOCKS, BS, BPB)
        self.table.configure_tenants([Tenant(t, quota_mib=q) for t, q in TENANTS.items()])
        self.policy = AllocatorPolicy(BS, defer_steps=3)
        self.requests: dict[str, Request] = {}
        self.inbox: list[tuple[str, str]] = []   # the engine's: (add | abort | fail, seq id)
        self.queue: list = []                    # generators waiting for (the first holds) the flush lock
        self.engine_busy = False                 # the engine thread waits on its own call in the queue
        self.up = True                           # the link
        self.count = 0

    # -- the bridge -------------------------------------------------------------------------------

    def trouble(self) -> None:
        self.up = False

    def wake(self, seq_ids) -> None:
        for s in seq_ids:
            r = self.requests.get(s)
            if r is not None and r.stage == "asking":
                r.stage = "woken"

    def kick(self, send: bool = True) -> None:
        if send:
            self.queue.append(self.send(in_call=False))

    def send(self, in_call: bool):
        """``_send``: what is queued, bookkeeping first; ``in_call``: inside the engine's ``_call``,
        whose timeout cancels it wherever it stands."""
        asks = self.policy.take_asks()
        batch = self.policy.take() if self.up else Bookkeeping()
        results: list = [None] * len(asks)
        try:
            if batch:
                yield from self.send_batch(batch, in_call)
            if asks and self.up:
                results = yield from self.allocate_many(asks, in_call)
                again = self.policy.first.asks_again(asks, results)  # refused for their reserve: without it
                if again and self.up:
                    for (i, request), result in zip(again, (yield from self.allocate_many([r for _, r in again], in_call))):
                        asks[i], results[i] = request, result
        finally:  # cancelled too: every ask taken is answered, its request woken
            if asks:
                self.kick(self.policy.fold_asks(asks, results))
                self.wake(r.seq_id for r in asks)

    def allocate_many(self, asks: list[AllocateRequest], in_call: bool):
        """``_send_asks``: block_service's answers, ``None`` each where none came back."""
        results: list = [None] * len(asks)
        fate = yield
        if fate != "unapplied":
            try:
                results = self.table.allocate_many(asks)
            except AlreadyExists:  # one id already live: nothing applied, each asks again
                pass
        yield
        if fate != "ok":
            self.trouble()
            if in_call:
                raise Lost
            return [None] * len(asks)
        return results

    def send_batch(self, batch: Bookkeeping, in_call: bool):
        """``_send_batch``: one that did not reach block_service (or whose answer did not come
        back) is queued again, for the resync to sort out."""
        fate = yield
        if fate != "unapplied":
            result, _ = apply_bookkeeping(self.table, batch.topups, batch.commits, batch.releases)
        yield
        if fate != "ok":
            self.policy.requeue(batch)
            self.trouble()
            if in_call:
                raise Lost
            return
        self.policy.fold_topups(batch.topups, result.growth)
        if any(e.code == "NOT_FOUND" and e.kind != "release" for e in result.errors):
            self.trouble()

    def call(self, rpc, unavailable, then):
        """``_call``: the engine thread waits; its answer goes to ``then``."""
        def run():
            answer = unavailable()
            try:
                yield from self.send(in_call=True)
                if self.up:
                    answer = yield from rpc()
            except Lost:
                self.trouble()
            self.engine_busy = False
            then(answer)

        if not self.up:
            then(unavailable())
            return
        self.engine_busy = True
        self.queue.append(run())

    def sync(self, periodic: bool):
        if periodic and self.up:
            yield from self.send(in_call=False)
        batch, live = self.policy.take_for_sync()
        fate = yield
        if fate != "unapplied":
            listed = [ListedSequence(s.seq_id, s.tenant, tuple(s.block_ids), s.num_tokens) for s in live]
            result = self.table.sync_node(NODE, NUM_BLOCKS, BS, BPB, listed)
        yield
        if fate != "ok":
            self.policy.requeue(batch)
            self.trouble()
            return
        was_up, self.up = self.up, True
        refused = [s for s, _ in result.refused]
        resend = self.policy.after_sync(batch, refused)
        if resend:
            yield from self.send_batch(resend, in_call=False)
        leaked = set(result.released) - set(batch.releases)
        if periodic and was_up:
            assert not leaked, f"a reconciliation released what the node no longer knew: {sorted(leaked)}"
        self.inbox += [("fail", s) for s in refused]

    # -- the loop: streams ------------------------------------------------------------------------

    @rule(tenant=st.sampled_from(sorted(TENANTS)), prompt=st.sampled_from(PROMPTS))
    def arrive(self, tenant: str, prompt: int) -> None:
        """A start command: its task (``RequestStream.run``) runs later; a cancel in the same
        message may end the request first."""
        self.count += 1
        r = Request(f"r{self.count}", tenant, prompt)
        self.requests[r.seq_id] = r

    @precondition(lambda self: any(r.stage == "started" for r in self.requests.values()))
    @rule(data=st.data())
    def run_starts(self, data: st.DataObject) -> None:
        """``RequestStream.run``: nothing for a request that already ended; else ``preallocate``
        (with the link down it returns at once, else it asks and waits)."""
        r = data.draw(st.sampled_from([r for r in self.requests.values() if r.stage == "started"]))
        if r.ended:
            r.stage = "gone"
        elif not self.up:
            r.stage = "woken"
        else:
            r.stage = "asking"
            self.kick(self.policy.ask(AllocateRequest(NODE, r.seq_id, r.tenant, r.hashes(r.prompt), r.prompt)))

    @precondition(lambda self: any(r.stage == "woken" for r in self.requests.values()))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        """``RequestStream.run`` after its early allocation: hand the request to the engine."""
        r = data.draw(st.sampled_from([r for r in self.requests.values() if r.stage == "woken"]))
        r.stage = "gone" if r.ended else "submitted"
        if not r.ended:
            self.inbox.append(("add", r.seq_id))

    @precondition(lambda self: any(not r.ended for r in self.requests.values()))
    @rule(data=st.data())
    def stream_ends(self, data: st.DataObject) -> None:
        """A cancel (or the end after the engine finished): abort in the engine's inbox, then
        ``release_early`` on the loop (``release_unclaimed``), which also wakes a waiting preallocation."""
        r = data.draw(st.sampled_from([r for r in self.requests.values() if not r.ended]))
        r.ended = True
        self.inbox.append(("abort", r.seq_id))
        self.kick(self.policy.release_unclaimed([r.seq_id]))
        self.wake([r.seq_id])

    @rule()
    def flush(self) -> None:
        self.kick()

    @precondition(lambda self: self.up)
    @rule()
    def reconcile(self) -> None:
        self.queue.append(self.sync(periodic=True))

    @precondition(lambda self: not self.up)
    @rule()
    def resync(self) -> None:
        self.queue.append(self.sync(periodic=False))

    @precondition(lambda self: self.queue)
    @rule(fate=st.sampled_from(FATES))
    def advance(self, fate: str) -> None:
        """The call holding the flush lock goes on to its next ``await``."""
        self.step(fate)

    def step(self, fate: str) -> None:
        head = self.queue[0]
        try:
            head.send(None if getgeneratorstate(head) == GEN_CREATED else fate)
        except StopIteration:
            self.queue.pop(0)

    # -- the engine thread ------------------------------------------------------------------------

    @precondition(lambda self: self.inbox and not self.engine_busy)
    @rule()
    def engine_inbox(self) -> None:
        """Between steps: add, abort or fail a request (an abort frees what the engine holds)."""
        what, seq_id = self.inbox.pop(0)
        r = self.requests[seq_id]
        if what == "add":
            r.in_engine = True
        elif r.in_engine:
            r.in_engine = False
            if r.block_table:
                self.kick(self.policy.release([seq_id]))
                r.block_table = []

    def engine_seqs(self, running: bool) -> list[Request]:
        return [r for r in self.requests.values() if r.in_engine and bool(r.block_table) == running]

    @precondition(lambda self: not self.engine_busy and self.engine_seqs(running=False))
    @rule(data=st.data(), mismatch=st.booleans())
    def engine_admits(self, data: st.DataObject, mismatch: bool) -> None:
        """The scheduler admits a waiting sequence: its early allocation if asked the same way
        (``mismatch``: the engine hashed differently; the early one is given back), else a call."""
        r = data.draw(st.sampled_from(self.engine_seqs(running=False)))
        length = r.length or r.prompt
        hashes = r.hashes(length)[:0 if mismatch else None]
        self.policy.begin_step()
        early = self.policy.allocate(r.seq_id, hashes, length)
        if early is not None:
            self.admitted(r, length, early)
            return

        def ask(asked: int):
            fate = yield
            if fate != "unapplied":
                result = self.table.allocate(NODE, r.seq_id, r.tenant, hashes, asked)
            yield
            if fate != "ok":
                raise Lost
            if isinstance(result, Allocation):  # claimed inside the flush lock
                return self.policy.claim(r.seq_id, r.tenant, result, length, asked)
            return result

        def rpc():
            """Through the reserve block; refused for it, the blocks alone (a call of its own)."""
            asked = self.policy.first.ask_tokens(hashes, length)
            result = yield from ask(asked)
            plain = self.policy.first.without_reserve(length, asked, result) if isinstance(result, Refusal) else None
            if plain is None:
                return result
            yield from self.send(in_call=True)
            if not self.up:
                return Refusal.unavailable(NODE)
            return (yield from ask(plain))

        self.call(rpc, lambda: Refusal.unavailable(NODE), lambda result: self.admitted(r, length, result))

    def admitted(self, r: Request, length: int, result: Allocation | Refusal) -> None:
        if isinstance(result, Allocation):
            r.block_table, r.length, r.committed = list(result.block_ids), length, result.num_cached_blocks
        self.end_step()

    def end_step(self) -> None:
        self.kick(self.policy.end_step())

    @precondition(lambda self: not self.engine_busy and self.engine_seqs(running=True))
    @rule(data=st.data())
    def engine_decodes(self, data: st.DataObject) -> None:
        """Commit the blocks the sequence filled, then grow it by a token."""
        r = data.draw(st.sampled_from(self.engine_seqs(running=True)))
        self.policy.begin_step()
        full = r.length // BS
        if full > r.committed:
            self.policy.commit([(r.seq_id, i, block_hash(r.seq_id, r.prompt, i)) for i in range(r.committed, full)])
            r.committed = full
        growth = [(r.seq_id, r.length + 1)]
        grown = self.policy.extend(growth)
        if grown.answers:
            self.grown(r, grown.answers[r.seq_id])
            return

        def rpc():
            asks = self.policy.extend_asks(grown.short)
            try:
                while asks:
                    fate = yield
                    if fate != "unapplied":
                        results = self.table.extend(asks)
                    yield
                    if fate != "ok":
                        raise Lost
                    asks = self.policy.fold_extend(asks, results)
            except Lost:
                self.policy.abandon_extend()
                raise
            return self.policy.hand_over()[r.seq_id]

        self.call(rpc, lambda: Refusal.unavailable(NODE), lambda answer: self.grown(r, answer))

    def grown(self, r: Request, answer: list[int] | Refusal) -> None:
        if isinstance(answer, list):
            r.block_table += answer
            r.length += 1
        elif not answer.transient:  # refused: the scheduler preempts it
            self.kick(self.policy.release([r.seq_id]))
            r.block_table = []
        self.end_step()

    @precondition(lambda self: not self.engine_busy and self.engine_seqs(running=True))
    @rule(data=st.data(), finish=st.booleans())
    def engine_preempts_or_finishes(self, data: st.DataObject, finish: bool) -> None:
        """Preempted: released, back to waiting, re-allocated later under the same id. Finished:
        released, the request leaves the engine (its stream ends later)."""
        r = data.draw(st.sampled_from(self.engine_seqs(running=True)))
        self.policy.begin_step()
        self.policy.release([r.seq_id])
        r.block_table = []
        r.in_engine = not finish
        self.end_step()

    # -- checks -----------------------------------------------------------------------------------

    @invariant()
    def block_service_is_consistent(self) -> None:
        if hasattr(self, "table"):
            self.table.check()

    @rule()
    def settle(self) -> None:
        """Let every call finish and send what is queued, with every answer arriving, and the
        engine take its aborts; then no preallocation waits, nothing is held for a request that
        is over, and block_service holds exactly the node's live sequences."""
        self.settle_bridge()
        waiting = [r.seq_id for r in self.requests.values() if r.stage == "asking"]
        assert not waiting, f"preallocations never answered: {waiting}"
        while self.inbox:  # the engine takes its aborts (its calls need block_service no more)
            self.engine_inbox()
        self.settle_bridge()
        orphans = [s.seq_id for s in self.policy.live_sequences()
                   if self.requests[s.seq_id].ended and not self.requests[s.seq_id].in_engine]
        assert not orphans, f"held for requests that are over: {orphans}"
        # (blocks, length): a first allocation through its reserve block is that long at block_service
        held = {s[0]: (list(s[3]), s[4]) for s in self.table.to_dict()["sequences"] if s[1] == NODE}
        live = {s.seq_id: (list(s.block_ids), s.num_tokens) for s in self.policy.live_sequences()}
        assert held == live, f"block_service holds {held}, the node knows {live}"

    def settle_bridge(self) -> None:
        for _ in range(4):  # a flush's answers may queue more (a grant of a request that ended)
            self.kick()
            for _ in range(500):
                if self.queue:
                    self.step("ok")
                elif not self.up:
                    self.resync()
                else:
                    break
        assert not self.queue, "the bridge did not settle"

    def teardown(self) -> None:
        if hasattr(self, "table"):
            self.settle()


AccountingMachine.TestCase.settings = settings(max_examples=examples(300), stateful_step_count=60, deadline=None)
TestAccountingMachine = AccountingMachine.TestCase
