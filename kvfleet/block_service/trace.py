"""A seeded, realistic stream of page-table calls, for the benchmark and the recovery tests.

Prompts start with one of a few shared prefixes (system prompts, few-shot examples) followed by a
private part; each step every live sequence grows by one block (``block_size`` decoded tokens), its
newly full blocks are committed, finished or refused sequences are released, and new ones arrive.

``Trace.step()`` is a generator: it yields ``(method, args)`` calls in the page table's own
signatures and expects each call's result sent back, so one trace drives the core in-process,
the durable layer, or the gRPC client alike (see ``drive``).
"""

from __future__ import annotations

import random
from collections.abc import Generator, Sequence
from dataclasses import dataclass

from kvfleet.core.allocator import AllocateRequest, Allocation

Call = tuple[str, tuple]


@dataclass(slots=True)
class _Live:
    seq_id: str
    node_id: str
    tenant: str
    num_tokens: int
    target: int          # released once it holds this many tokens
    hashes: list[bytes]  # hash of each block, by index (prefix hashes first)
    num_committed: int


class Trace:
    def __init__(
        self,
        seed: int = 0,
        node_ids: Sequence[str] = ("n0",),
        tenants: Sequence[str] = ("t0",),
        block_size: int = 16,
        num_prefixes: int = 8,
        prefix_blocks: int = 16,
        private_tokens: tuple[int, int] = (1, 256),
        output_tokens: tuple[int, int] = (16, 512),
        arrivals_per_step: int = 8,
        name: str = "s",
    ) -> None:
        self.rng = random.Random(seed)
        self.node_ids, self.tenants, self.block_size = list(node_ids), list(tenants), block_size
        self.prefixes = [[self.rng.randbytes(16) for _ in range(prefix_blocks)] for _ in range(num_prefixes)]
        self.private_tokens, self.output_tokens = private_tokens, output_tokens
        self.arrivals_per_step = arrivals_per_step
        self.name = name  # prefix of the sequence ids, so that several traces can share a table
        self.live: dict[str, _Live] = {}
        self.finished: list[str] = []
        self.num_seqs = 0
        self.block_ops = 0  # blocks granted, appended, committed and released so far

    def _new_sequence(self) -> _Live:
        rng, bs = self.rng, self.block_size
        prefix = self.prefixes[rng.randrange(len(self.prefixes))]
        prompt = len(prefix) * bs + rng.randint(*self.private_tokens)
        self.num_seqs += 1
        return _Live(
            f"{self.name}{self.num_seqs}", rng.choice(self.node_ids), rng.choice(self.tenants), prompt,
            prompt + rng.randint(*self.output_tokens), list(prefix), 0,
        )

    def _full_block_commits(self, seq: _Live) -> list[tuple[str, int, bytes]]:
        full = seq.num_tokens // self.block_size
        while len(seq.hashes) < full:
            seq.hashes.append(self.rng.randbytes(16))
        commits = [(seq.seq_id, i, seq.hashes[i]) for i in range(seq.num_committed, full)]
        seq.num_committed = full
        return commits

    def step(self) -> Generator[Call, object, None]:
        bs = self.block_size
        yield from self._release_finished()
        growing = list(self.live.values())
        if growing:
            results = yield "extend", ([(s.seq_id, s.num_tokens + bs) for s in growing],)
            for seq, new in zip(growing, results):
                if isinstance(new, list):
                    seq.num_tokens += bs
                    self.block_ops += len(new)
                else:  # preempted: drop it
                    seq.target = seq.num_tokens
        arrivals = [self._new_sequence() for _ in range(self.arrivals_per_step)]
        results = yield "allocate_many", ([
            AllocateRequest(s.node_id, s.seq_id, s.tenant, s.hashes[: s.num_tokens // bs], s.num_tokens)
            for s in arrivals
        ],)
        for seq, alloc in zip(arrivals, results):
            if isinstance(alloc, Allocation):
                seq.num_committed = alloc.num_cached_blocks
                self.live[seq.seq_id] = seq
                self.block_ops += len(alloc.block_ids)
        commits = [c for s in self.live.values() for c in self._full_block_commits(s)]
        if commits:
            yield "commit", (commits,)
            self.block_ops += len(commits)
        self.finished = [s.seq_id for s in self.live.values() if s.num_tokens >= s.target]

    def drain(self) -> Generator[Call, object, None]:
        """Release every live sequence."""
        self.finished = list(self.live)
        yield from self._release_finished()

    def _release_finished(self) -> Generator[Call, object, None]:
        if self.finished:
            done = [self.live.pop(s) for s in self.finished]
            yield "release", ([s.seq_id for s in done],)
            self.block_ops += sum(-(-s.num_tokens // self.block_size) for s in done)
            self.finished = []


def drive(target: object, calls: Generator[Call, object, None]) -> None:
    """Run one step's calls on ``target`` (anything with the page table's method names)."""
    try:
        call = next(calls)
        while True:
            method, args = call
            call = calls.send(getattr(target, method)(*args))
    except StopIteration:
        pass


async def drive_async(target: object, calls: Generator[Call, object, None]) -> None:
    """``drive`` for a target whose methods are coroutines (the gRPC client)."""
    try:
        call = next(calls)
        while True:
            method, args = call
            call = calls.send(await getattr(target, method)(*args))
    except StopIteration:
        pass
