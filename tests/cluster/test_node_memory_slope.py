"""A regression tripwire for issue 35: one real node serves a few thousand short requests (some
cancelled) and its resident memory, sampled all along, must not climb at a rate far above the goal.

The goal is 5 MiB an hour per process (``bench/soak.py --minutes 30`` measures it). This test fits a
line through VmRSS after a warm-up, over a minute or more, and fails only above ``THRESHOLD_MIB_H``,
20x the goal. Why there: a warm node's samples spread by a few tenths of a MiB (AMD EPYC, 2 cores,
at load 20: 498.2-498.5 MiB; fitted +0.2 MiB/h over 102 s and +4.9 over 73 s in two runs), which is
noise of a few MiB/h at most over such a window. What a short window cannot tell from a leak is a
step, glibc growing an arena once, which a least-squares line reads as about 1.5 x step / window:
over 60 s a step of 1.1 MiB reaches 100 MiB/h, several times the spread seen. A leak grows with the
requests instead: issue 35's 95 MiB/h came at ~20 requests a second, about 1.3 KiB a request, and
this test sends them at least as fast. The bar is not lower because the window is short, and not
higher because then issue 35's leak would pass. No timing is asserted: the figure is MiB per hour
of the test's own run, whatever its speed.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import grpc
from cluster_helpers import BLOCK_SIZE

from kvfleet.cli.loadgen.rss_slope import rss_slope
from kvfleet.cli.loadgen.server_side import rss_mib
from kvfleet.core import certs, rpc, tls
from kvfleet.core.identity import ROUTER_ID, Identity
from kvfleet.v1 import compute_pb2, compute_pb2_grpc

GOAL_MIB_H = 5.0
THRESHOLD_MIB_H = 20 * GOAL_MIB_H
MIN_REQUESTS = 2000
WARMUP_REQUESTS = 400      # the fit starts after these: the prefix cache, allocator arenas and torch's caches fill
MIN_FIT_S = 60             # and runs this long at least (more requests on a fast machine): a slope needs time
CONCURRENCY = 8
CANCEL_EVERY = 10          # every tenth request is cancelled after its first tokens, as clients do
SAMPLE_EVERY_S = 0.5
NODE = "node-0"


def prompts(count: int = 48, seed: int = 35) -> list[list[int]]:
    """Short prompts of 1-4 blocks (ids < 256: the test model's vocabulary), reused: hits and misses both."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(8, 4 * BLOCK_SIZE))] for _ in range(count)]


async def drive(cluster, node_id: str, book: list[list[int]], keep_going, on_done) -> Counter:
    """Greedy requests on one Serve stream, as the router writes them, ``CONCURRENCY`` in flight,
    while ``keep_going(started)``; ``on_done(n)`` after each one ends. Counts outcomes: finished,
    cancelled, error."""
    as_router = tls.Credentials.load(certs.identity_dir(cluster.certs.root, ROUTER_ID), ROUTER_ID)
    outcomes: Counter = Counter()
    started = 0
    live: set[str] = set()
    address = f"127.0.0.1:{cluster.nodes[node_id].port}"
    async with rpc.channel(address, peer=Identity.node(node_id), credentials=as_router) as channel:
        call = compute_pb2_grpc.ComputeStub(channel).Serve()

        def start_command() -> compute_pb2.NodeCommand:
            nonlocal started
            request = compute_pb2.ComputeRequest(request_id=f"r{started}", tenant="gold",
                                                 prompt_token_ids=book[started % len(book)])
            request.sampling.max_tokens = 4 + started % 13
            request.sampling.ignore_eos = True
            live.add(request.request_id)
            started += 1
            return compute_pb2.NodeCommand(start=request)

        await call.write(compute_pb2.NodeCommands(commands=[start_command() for _ in range(CONCURRENCY)]))
        while live:
            message = await call.read()
            assert message is not grpc.aio.EOF, f"the node ended the stream after {sum(outcomes.values())} requests"
            commands = []
            for event in message.events:
                if event.request_id not in live:
                    continue  # cancelled: what was already on its way
                ended = "error" if event.HasField("error") else "finished" if event.chunk.finish_reason else None
                if ended is None and int(event.request_id[1:]) % CANCEL_EVERY == 0:
                    commands.append(compute_pb2.NodeCommand(cancel=event.request_id))
                    ended = "cancelled"
                if ended:
                    live.discard(event.request_id)
                    outcomes[ended] += 1
                    on_done(sum(outcomes.values()))
                    if keep_going(started):
                        commands.append(start_command())
            if commands:
                await call.write(compute_pb2.NodeCommands(commands=commands))
        await call.done_writing()
    return outcomes


def test_a_node_serving_thousands_of_requests_does_not_grow(start_cluster):
    cluster = start_cluster(1, dtype="float32")  # pinned: not the host's default (bfloat16 on AMX)
    pid = cluster.nodes[NODE].process.pid
    clock = time.monotonic
    samples: list[tuple[float, int, float | None]] = []
    warm = {}

    def on_done(n: int) -> None:
        if n == WARMUP_REQUESTS:
            warm["t"] = clock()

    def keep_going(started: int) -> bool:
        return started < MIN_REQUESTS or "t" not in warm or clock() - warm["t"] < MIN_FIT_S

    async def run() -> Counter:
        sampling = True

        async def sample() -> None:
            while sampling:
                samples.append((clock(), pid, rss_mib(pid)))
                await asyncio.sleep(SAMPLE_EVERY_S)

        sampler = asyncio.create_task(sample())
        try:
            return await drive(cluster, NODE, prompts(), keep_going, on_done)
        finally:
            sampling = False
            await sampler

    outcomes = asyncio.run(run())
    assert sum(outcomes.values()) >= MIN_REQUESTS and not outcomes["error"] and outcomes["cancelled"], outcomes
    t0 = samples[0][0]
    slope = rss_slope([(t - t0, p, mib) for t, p, mib in samples], warmup_s=warm["t"] - t0)
    series = ", ".join(f"{t - t0:.0f}s {mib:.1f}" for t, _, mib in samples[:: max(1, len(samples) // 12)] if mib)
    assert slope.mib_per_hour is not None, slope.reason
    print(f"{NODE}: {slope.mib_per_hour:+.1f} MiB/h after warm-up ({slope.samples} samples, {slope.span_s:.0f} s), "
          f"{sum(outcomes.values())} requests; MiB: {series}")
    assert slope.mib_per_hour <= THRESHOLD_MIB_H, (
        f"{NODE}'s resident memory grew {slope.mib_per_hour:.0f} MiB/h after warm-up over {slope.samples} samples "
        f"({slope.span_s:.0f} s), above the tripwire's {THRESHOLD_MIB_H:.0f} (goal {GOAL_MIB_H:g}); MiB: {series}")
