"""One bench run against one router: probe it, read its counters, run the chosen phases in order,
read the counters again. Shared by ``kvfleet bench`` (any router) and ``kvfleet tune`` (one fresh
local cluster per candidate)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvfleet.cli.loadgen.client import Client, monotonic_since
from kvfleet.cli.loadgen.phases import PhasePlan, PhaseResult, Phases
from kvfleet.cli.loadgen.progress import Progress
from kvfleet.cli.loadgen.samplers import Sample, Sampler
from kvfleet.cli.loadgen.server_side import RouterCounters, router_counters

DEFAULT_CONCURRENCY = 4


@dataclass(slots=True, frozen=True)
class Target:
    router: str
    api_key: str
    block_service: str | None = None            # KV usage: None, not read
    router_metrics: str | None = None           # the router's /metrics URL: None, not read
    pids: Callable[[], Mapping[str, int]] = dict  # local processes whose RSS is sampled


@dataclass(slots=True)
class Outcome:
    results: list[PhaseResult]
    samples: list[Sample]
    kv_problem: str | None
    counters: RouterCounters | None = None      # the router's, during the phases
    notes: list[str] = field(default_factory=list)


async def _run(target: Target, plan: PhasePlan, phases: tuple[str, ...], timeout_s: float, sample_every_s: float,
               progress: Progress) -> Outcome:
    clock = monotonic_since()
    client = Client(target.router, target.api_key, timeout_s, clock)
    try:
        await client.probe()  # RouterProblem: the caller prints its line
        sampler = Sampler(clock, target.block_service, target.pids, sample_every_s)
        before = await asyncio.to_thread(router_counters, target.router_metrics) if target.router_metrics else None
        run = Phases(client, sampler, plan, progress)
        results: list[PhaseResult] = []
        concurrency = plan.concurrency
        with progress:
            if "fixed" in phases:
                results.append(await run.fixed())
                concurrency = concurrency or results[-1].best_concurrency()
            concurrency = concurrency or DEFAULT_CONCURRENCY
            if "mixed" in phases:
                results.append(await run.mixed(concurrency))
            if "soak" in phases:
                results.append(await run.soak(concurrency))
        await sampler.settle()
        outcome = Outcome(results, sampler.samples, sampler.problem)
        if before is not None:
            outcome.counters = (await settled_counters(target.router_metrics)).minus(before)
        return outcome
    finally:
        await client.close()


async def settled_counters(url: str, timeout_s: float = 5.0) -> RouterCounters:
    """The router counts a request as it closes the stream, a moment after its client read the
    last chunk: scrape until two scrapes agree."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last = await asyncio.to_thread(router_counters, url)
    while loop.time() < deadline:
        await asyncio.sleep(0.2)
        now = await asyncio.to_thread(router_counters, url)
        if now == last:
            break
        last = now
    return last


def run_session(target: Target, plan: PhasePlan, phases: tuple[str, ...], timeout_s: float = 120.0,
                sample_every_s: float = 0.5, progress: Progress | None = None) -> Outcome:
    return asyncio.run(_run(target, plan, phases, timeout_s, sample_every_s, progress or Progress()))
