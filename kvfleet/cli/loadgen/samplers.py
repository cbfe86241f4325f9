"""KV usage and process memory over time, sampled in the background while a phase runs.

Blocks in use are block_service's own count (its Stats answer: ``num_used`` per node, summed over
the nodes), the same figures ``kvfleet blocks`` shows. Process memory is the VmRSS of the local
cluster's processes; against a remote router there is nothing of ours to read, and the summary says
so instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvfleet.cli.loadgen.server_side import rss_mib


@dataclass(slots=True, frozen=True)
class Sample:
    t_s: float                        # seconds since the bench started
    phase: str
    blocks_used: int | None           # over all nodes; None without block_service
    blocks_total: int | None
    rss_mib: dict[str, float]         # process name → MiB (empty when remote)


@dataclass(slots=True)
class Sampler:
    """``async with sampler.running(phase): ...`` samples every ``interval_s`` until the block ends."""

    clock: Callable[[], float]
    block_service: str | None          # address, None: no KV figures
    pids: Callable[[], Mapping[str, int]] = dict  # name → pid now (a restarted process has a new one)
    interval_s: float = 0.5
    samples: list[Sample] = field(default_factory=list)
    problem: str | None = None         # why KV usage stopped being read, once it failed

    async def sample(self, phase: str, client=None) -> Sample:
        used = total = None
        if client is not None and self.problem is None:
            try:
                nodes, _ = await client.stats()
                used, total = sum(n.num_used for n in nodes), sum(n.num_blocks for n in nodes)
            except Exception as err:  # a bench outlives block_service trouble; it reports it once
                self.problem = f"block_service at {self.block_service}: {err}"
        rss = {name: mib for name, pid in self.pids().items() if (mib := rss_mib(pid)) is not None}
        s = Sample(self.clock(), phase, used, total, rss)
        self.samples.append(s)
        return s

    async def settle(self, timeout_s: float = 10.0) -> None:
        """After the last phase: sample (phase ``after``) until no block is in use or ``timeout_s``
        passes. A node hands its finished requests' blocks back in its next batch, a moment after
        their clients read the last token, so the end of the load is not yet the end of the usage."""
        if not self.block_service:
            return
        from kvfleet.block_service.client import BlockManagerClient

        async with BlockManagerClient(self.block_service, timeout_s=5.0) as client:
            deadline = self.clock() + timeout_s
            while (await self.sample("after", client)).blocks_used and self.clock() < deadline:
                await asyncio.sleep(0.2)

    @contextlib.asynccontextmanager
    async def running(self, phase: str):
        from kvfleet.block_service.client import BlockManagerClient

        client = BlockManagerClient(self.block_service, timeout_s=5.0) if self.block_service else None
        stop = asyncio.Event()

        async def loop() -> None:
            while not stop.is_set():
                await self.sample(phase, client)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval_s)

        task = asyncio.create_task(loop())
        try:
            yield self
        finally:
            stop.set()
            await task
            await self.sample(phase, client)  # the end of the phase: what is still held
            if client is not None:
                await client.close()
