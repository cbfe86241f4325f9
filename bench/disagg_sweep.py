"""bench/disagg.py's threshold sweep: below which uncached prompt length a hand-over costs more than it saves.

On the disagg arm's cluster (one prefill node, one decode node), while one stream decodes on the
decode node (``decoding``: a short prompt, thousands of greedy tokens, cancelled at the end), one
request at a time, each a fresh random prompt (nothing cached anywhere), 8 greedy tokens, per
prompt length:

    always   the router restarted with ``--disagg-min-uncached-tokens 1``: prefilled on the prefill
             node, its first token streamed, handed over; the decode node fetches the prompt's KV
    never    the router restarted with ``--disagg-min-uncached-tokens 1000000000``: the decode node
             prefills it (in chunks, at the nodes' short-prompts-first threshold) and decodes it

What the decode node's streams pay is the decoding stream's longest gap while the request runs
(``decoding_max_gap_ms``): a prefill chunk's step (never) against the fetch and the hand-over's
admission (always). The hand-over pays where never's gap is the longer; ``crossover_tokens`` is the
shortest swept length from which it pays at every longer one (None: at none). What the request
itself pays: ``handover_cost_s``, always's gap from its first token to its second less never's,
against never's time to first token. One request per length and side: on a shared machine, read
the order of magnitude.
"""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.disagg_client import Outcome, generate, server_figures

ALWAYS, NEVER = 1, 1_000_000_000
FLAG = "--disagg-min-uncached-tokens"
MAX_TOKENS = 8
DECODING_TOKENS = 4000  # the decoding stream's limit: more than the sweep takes


def set_router_threshold(cluster, tokens: int) -> None:
    """Restart the cluster's router with ``--disagg-min-uncached-tokens tokens`` (same port, same log)."""
    router = cluster.child("router")
    cluster.kill("router", signal.SIGTERM)
    router.process.wait(60)
    router.argv[router.argv.index(FLAG) + 1] = str(tokens)
    cluster.restart("router")
    cluster.wait_router()


@dataclass(slots=True)
class Measured:
    request: Outcome
    fetch_s: float             # the decode node's KV fetch for it
    fetched_mib: float
    decoding_gaps_s: list[float]  # the decoding stream's gaps that ended while it ran


async def _one_by_one(cluster, prompts: list[list[int]], vocab: int) -> list[Measured]:
    """Each prompt alone, in turn, while a stream decodes on the decode node."""
    import grpc

    from kvfleet.v1 import inference_pb2_grpc

    rng = random.Random(7)
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        # the router's view of both nodes settles, its channels to them open: not measured
        await generate(stub, [rng.randrange(vocab) for _ in range(64)], MAX_TOKENS)
        decoding = Outcome("decoding", time.perf_counter())
        task = asyncio.create_task(generate(stub, [rng.randrange(vocab) for _ in range(64)], DECODING_TOKENS,
                                            into=decoding))
        while len(decoding.times) < 3 and not task.done():
            await asyncio.sleep(0.05)
        done = []
        for prompt in prompts:
            before = server_figures(cluster)
            outcome = await generate(stub, prompt, MAX_TOKENS)
            after = server_figures(cluster)
            gaps = [b - a for a, b in zip(decoding.times, decoding.times[1:]) if outcome.sent_at < b <= outcome.times[-1]]
            done.append(Measured(outcome, after["fetch_s"] - before["fetch_s"],
                                 (after["fetched_bytes"] - before["fetched_bytes"]) / (1 << 20), gaps))
        if task.done():
            task.result()  # the decoding stream failed: say why
            raise SystemExit(f"disagg sweep: the decoding stream ended after {len(decoding.times)} tokens")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return done


def threshold_sweep(cluster, lengths: tuple[int, ...], vocab: int, progress: Callable[[str], None]) -> dict:
    from kvfleet.core.event_loop import run as run_loop

    rng = random.Random(1)
    sides = {}
    for side, threshold in (("always", ALWAYS), ("never", NEVER)):
        set_router_threshold(cluster, threshold)
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        sides[side] = run_loop(_one_by_one(cluster, prompts, vocab))
        progress(f"sweep, {side}: {[round(m.request.ttft_s, 3) for m in sides[side]]} s to the first token")
    rows = {}
    for n, always, never in zip(lengths, sides["always"], sides["never"]):
        a, b = always.request, never.request

        def ms(gaps: list[float], pick) -> float | None:
            return round(pick(gaps) * 1e3, 1) if gaps else None

        rows[str(n)] = dict(
            decoding_max_gap_ms_always=ms(always.decoding_gaps_s, max),
            decoding_max_gap_ms_never=ms(never.decoding_gaps_s, max),
            decoding_mean_gap_ms_always=ms(always.decoding_gaps_s, statistics.fmean),
            decoding_mean_gap_ms_never=ms(never.decoding_gaps_s, statistics.fmean),
            ttft_s_always=round(a.ttft_s, 3), ttft_s_never=round(b.ttft_s, 3),
            handover_cost_s=round(a.gaps_s[0] - b.gaps_s[0], 3),
            total_s_always=round(a.times[-1] - a.sent_at, 3), total_s_never=round(b.times[-1] - b.sent_at, 3),
            handed_over=len(set(a.nodes)) > 1 and len(set(b.nodes)) == 1,
            fetch_s=round(always.fetch_s, 3), fetched_mib=round(always.fetched_mib, 1),
            pays=bool(always.decoding_gaps_s and never.decoding_gaps_s
                      and max(never.decoding_gaps_s) > max(always.decoding_gaps_s)))
    pays = [rows[str(n)]["pays"] for n in lengths]
    crossover = next((n for i, n in enumerate(lengths) if all(pays[i:])), None)
    return dict(by_length=rows, crossover_tokens=crossover, max_tokens=MAX_TOKENS)
