"""The field guide's three phases, each a run of closed-loop clients against the router:

    fixed   every prompt ``context`` tokens; concurrency step, 2·step, 3·step, … until the stop
            rule (``analysis.StopRule``) sees refusals, timeouts or the latency knee
    mixed   prompt lengths drawn from the mix, at one concurrency, for a number of requests
    soak    the mix at one concurrency for a duration; process memory and blocks in use sampled
            throughout, and a linear fit of each says whether it drifts upward

KV usage is sampled during every phase (``samplers.Sampler``); each phase's figures are a
``PhaseResult``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvfleet.cli.loadgen.analysis import Drift, StopRule, drift
from kvfleet.cli.loadgen.client import Client, closed_loop
from kvfleet.cli.loadgen.progress import Progress
from kvfleet.cli.loadgen.records import PhaseStats, RequestRecord, summarize
from kvfleet.cli.loadgen.samplers import Sampler
from kvfleet.cli.loadgen.workload import Mix, Workload

PHASES = ("fixed", "mixed", "soak")


@dataclass(slots=True, frozen=True)
class PhasePlan:
    """What the phases send (every length already scaled)."""

    context: int
    mix: Mix
    max_tokens: int
    vocab_size: int
    step: int = 1                   # fixed: concurrency increment
    max_concurrency: int = 64
    requests_per_client: int = 4    # fixed: requests per step = concurrency × this
    stop_rule: StopRule = StopRule()
    concurrency: int | None = None  # mixed and soak; None: the fixed phase's best step, else 4
    mixed_requests: int = 32
    soak_s: float = 60.0
    seed: int = 0

    def __post_init__(self):
        for name in ("context", "max_tokens", "vocab_size", "step", "max_concurrency", "requests_per_client",
                     "mixed_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.step > self.max_concurrency:
            raise ValueError(f"--step {self.step} is above --max-concurrency {self.max_concurrency}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.soak_s <= 0:
            raise ValueError(f"--duration must be positive, got {self.soak_s}")

    def longest_request(self, phases: tuple[str, ...]) -> int:
        prompts = ([self.context] if "fixed" in phases else []) + \
            (list(self.mix.lengths) if {"mixed", "soak"} & set(phases) else [])
        return max(prompts, default=0) + self.max_tokens


@dataclass(slots=True)
class PhaseResult:
    name: str
    stats: PhaseStats
    records: list[RequestRecord]
    concurrency: int
    steps: list[tuple[int, PhaseStats]] = field(default_factory=list)  # fixed only
    stop_reason: str | None = None                                       # fixed only
    drifts: list[Drift] = field(default_factory=list)                    # soak only

    def best_concurrency(self) -> int:
        """The step with the most tokens/s among those without refusals (fixed), else the phase's."""
        clean = [(s.tokens_per_s, c) for c, s in self.steps if not s.refusals]
        return max(clean)[1] if clean else self.concurrency


class Phases:
    def __init__(self, client: Client, sampler: Sampler, plan: PhasePlan, progress: Progress):
        self.client = client
        self.sampler = sampler
        self.plan = plan
        self.progress = progress

    def _workload(self, mix: Mix, salt: int) -> Workload:
        return Workload(mix, self.plan.max_tokens, self.plan.vocab_size, seed=self.plan.seed * 1000 + salt)

    async def fixed(self) -> PhaseResult:
        plan, clock = self.plan, self.client.clock
        steps: list[tuple[int, PhaseStats]] = []
        records: list[RequestRecord] = []
        reason = None
        bar = self.progress.add("fixed: stepping up", None)
        started = clock()
        async with self.sampler.running("fixed"):
            concurrency = plan.step
            while concurrency <= plan.max_concurrency:
                self.progress.note(bar, f"concurrency {concurrency}")
                t0 = clock()
                got = await closed_loop(self.client, self._workload(Mix.single(plan.context), concurrency), "fixed",
                                        concurrency, count=concurrency * plan.requests_per_client,
                                        on_done=lambda r: self.progress.advance(bar))
                records += got
                steps.append((concurrency, summarize(got, clock() - t0)))
                reason = plan.stop_rule.reason([s for _, s in steps])
                if reason:
                    break
                concurrency += plan.step
        self.progress.note(bar, reason or f"reached --max-concurrency {plan.max_concurrency}")
        self.progress.finish(bar)
        return PhaseResult("fixed", summarize(records, clock() - started), records, steps[-1][0], steps,
                           reason or f"reached --max-concurrency {plan.max_concurrency}")

    async def mixed(self, concurrency: int) -> PhaseResult:
        clock = self.client.clock
        bar = self.progress.add(f"mixed: {concurrency} clients", self.plan.mixed_requests)
        t0 = clock()
        async with self.sampler.running("mixed"):
            records = await closed_loop(self.client, self._workload(self.plan.mix, 1), "mixed", concurrency,
                                        count=self.plan.mixed_requests, on_done=lambda r: self.progress.advance(bar))
        return PhaseResult("mixed", summarize(records, clock() - t0), records, concurrency)

    async def soak(self, concurrency: int) -> PhaseResult:
        clock = self.client.clock
        bar = self.progress.add(f"soak: {concurrency} clients", self.plan.soak_s)
        t0 = clock()
        first = len(self.sampler.samples)

        records: list[RequestRecord] = []

        def tick(_record) -> None:
            self.progress.note(bar, f"{len(records)} requests")

        async with self.sampler.running("soak"):
            progress_task = _ticker(self.progress, bar, clock, t0, self.plan.soak_s)
            try:
                records += await closed_loop(self.client, self._workload(self.plan.mix, 2), "soak", concurrency,
                                             until=t0 + self.plan.soak_s, on_done=tick)
            finally:
                progress_task.cancel()
        samples = self.sampler.samples[first:]
        drifts = soak_drifts(samples)
        return PhaseResult("soak", summarize(records, clock() - t0), records, concurrency, drifts=drifts)


def soak_drifts(samples) -> list[Drift]:
    """Blocks in use (against the pools' size) and each process's RSS (against its mean)."""
    out = []
    kv = [(s.t_s, s.blocks_used, s.blocks_total) for s in samples if s.blocks_used is not None]
    if kv:
        out.append(drift("blocks in use", [t for t, _, _ in kv], [u for _, u, _ in kv], reference=kv[0][2]))
    names = sorted({name for s in samples for name in s.rss_mib})
    for name in names:
        points = [(s.t_s, s.rss_mib[name]) for s in samples if name in s.rss_mib]
        out.append(drift(f"RSS MiB {name}", [t for t, _ in points], [v for _, v in points]))
    return out


def _ticker(progress: Progress, bar: int, clock, t0: float, total: float) -> asyncio.Task:
    """A task that moves the soak's bar with the clock (its total is seconds)."""

    async def tick() -> None:
        done = 0.0
        while True:
            now = min(clock() - t0, total)
            progress.advance(bar, now - done)
            done = now
            await asyncio.sleep(0.5)

    return asyncio.create_task(tick())
