"""The P99 batch controller under a load ramp well past saturation: p99 inter-token latency against
its target over time, with and without the controller, and the throughput given up for it.

    python bench/p99_controller.py [--quick] [--json] [--target-ms MS] [--seconds S] [--clients N]
                                   [--max-num-batched-tokens N]

In-process, not a cluster: the node's own ``AsyncEngine`` with the controller's ``LiveCap`` on its
step thread (exactly what ``kvfleet compute --p99-itl-target-ms`` runs), driven by asyncio clients
in the same process. On these shared 2-core machines a cluster's five processes would measure each
other more than the controller. Each client loops: a 32-token prompt, 32 greedy tokens, the next;
the number of clients ramps from 1 to ``--clients`` over the first 40% of a run and holds there. The
engine runs ``--max-num-seqs`` (64) sequences at most; requests above its cap wait in its queue.
Each step carries at most ``--max-num-batched-tokens`` (default 128: two per sequence, each running
sequence's token and as many prompt tokens again, as this 1:1 workload needs); the live cap scales
that budget in proportion (``Scheduler.set_num_seqs_cap``). With a budget of 2048 a step can prefill
a whole burst of admissions at once, and those steps are the tail (docs/benchmarks-history.md, "P99 batch controller").

Order: a batch-1 probe (one client), then four runs on the same engine, uncontrolled, controlled,
controlled, uncontrolled (the machine's drift hits both sides alike; each controlled run starts a
fresh controller at the maximum). Without ``--target-ms`` the target is placed between the two
measured ends, batch-1 p99 ITL and the first uncontrolled run's saturated p99:
``batch1 + 0.5 · (saturated − batch1)``.

Figures (the last 40% of each run, after the controller settled; both runs of a side pooled):
``p99_settled_ms`` (controlled) against ``target_ms`` and ``p99_uncontrolled_ms``;
``throughput_frac`` = controlled generated tokens over uncontrolled in the same windows. The plot
(first run of each side) goes to bench/results/p99_controller.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import add_smoke_flag, ensure_model, seeded_prompts  # noqa: E402

PROMPT_TOKENS = 32
MAX_TOKENS = 32
RAMP_SHARE = 0.4      # clients ramp up over this share of a run
SETTLED_SHARE = 0.4   # figures over the last share of a run
PLOT = ROOT / "bench" / "results" / "p99_controller.png"


@dataclass(slots=True)
class Run:
    name: str
    started: float
    itls: list[tuple[float, float]] = field(default_factory=list)   # (seconds into the run, ITL s)
    tokens: list[float] = field(default_factory=list)               # when each token came out
    caps: list[tuple[float, int]] = field(default_factory=list)     # (seconds, live cap)

    def window(self, start: float, end: float) -> tuple[list[float], int]:
        return [x for t, x in self.itls if start <= t < end], sum(1 for t in self.tokens if start <= t < end)


def p99(values: list[float]) -> float:
    from kvfleet.compute_service.engine.batch_controller import p99 as nearest_rank

    return nearest_rank(values) if values else float("nan")


async def client(engine, run: Run, index: int, stop: asyncio.Event) -> None:
    from kvfleet.core.sampling import SamplingParams

    sampling = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    i = 0
    while not stop.is_set():
        prompt = seeded_prompts(1, PROMPT_TOKENS, PROMPT_TOKENS, seed=100_000 * index + i)[0]
        last = None
        async for out in engine.generate(f"{run.name}-{index}-{i}", prompt, sampling):
            now = time.monotonic() - run.started
            if out.new_token_ids:
                run.tokens.extend([now] * len(out.new_token_ids))
                if last is not None:
                    run.itls.append((now, now - last))
                last = now
        i += 1


async def drive(engine, name: str, clients: int, seconds: float, live_cap=None) -> Run:
    """Ramp closed-loop clients 1 → ``clients`` over RAMP_SHARE of ``seconds``, hold, stop."""
    run = Run(name, time.monotonic())
    stop = asyncio.Event()
    tasks = []
    ramp = RAMP_SHARE * seconds
    while (now := time.monotonic() - run.started) < seconds:
        want = clients if now >= ramp else 1 + int((clients - 1) * now / ramp)
        while len(tasks) < want:
            tasks.append(asyncio.create_task(client(engine, run, len(tasks), stop)))
        if live_cap is not None:
            run.caps.append((now, live_cap.cap))
        await asyncio.sleep(0.25)
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    while engine.engine.has_unfinished_requests():  # aborts land on the step thread
        await asyncio.sleep(0.05)
    return run


def per_second_p99(run: Run, seconds: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for s in range(int(seconds)):
        window = [x for t, x in run.itls if s <= t < s + 1]
        if len(window) >= 5:
            xs.append(s + 0.5)
            ys.append(p99(window) * 1e3)
    return xs, ys


def plot(runs: list[Run], target_ms: float, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for run, color in zip(runs, ("tab:red", "tab:blue")):
        ax.plot(*per_second_p99(run, seconds), color=color, label=f"p99 ITL per second, {run.name}")
    ax.axhline(target_ms, color="black", linestyle="--", label=f"target {target_ms:.0f} ms")
    ax.axhline(target_ms * 1.1, color="gray", linestyle=":", label="target + 10%")
    ax.axvspan(seconds * (1 - SETTLED_SHARE), seconds, color="0.92", label="settled window")
    ax.set_xlabel("seconds into the run (clients ramp over the first 40%)")
    ax.set_ylabel("p99 inter-token latency (ms)")
    controlled = runs[-1]
    if controlled.caps:
        cap_axis = ax.twinx()
        cap_axis.step([t for t, _ in controlled.caps], [c for _, c in controlled.caps], where="post",
                      color="tab:green", alpha=0.6, label="live cap (controlled)")
        cap_axis.set_ylabel("live cap on running sequences")
        cap_axis.legend(loc="upper right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("P99 batch controller, in-process engine (shared 2-core CPU)")
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=110)


async def main_async(args) -> dict:
    import torch

    from kvfleet.compute_service.engine.async_engine import AsyncEngine
    from kvfleet.compute_service.engine.batch_controller import BatchController, ControllerConfig
    from kvfleet.compute_service.engine.live_cap import LiveCap
    from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine

    torch.set_num_threads(args.threads)
    model = ensure_model("tiny", ROOT / "models" / "bench-tiny") if args.smoke else ensure_model()  # smoke: models/bench-tiny
    engine = LLMEngine(model, EngineConfig(block_size=16, kv_cache_memory=512 << 20, max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens))
    probe_s = 1.0 if args.smoke else 6.0 if args.quick else 10.0
    plain = AsyncEngine(engine)
    batch1 = await drive(plain, "batch-1", 1, probe_s)
    settled = (args.seconds * (1 - SETTLED_SHARE), args.seconds)
    b1_ms = p99([x for _, x in batch1.itls]) * 1e3
    runs: dict[str, list[Run]] = {"uncontrolled": [], "controlled": []}
    target_ms = args.target_ms
    for kind in ("uncontrolled", "controlled", "controlled", "uncontrolled"):  # ABBA: drift hits both alike
        if kind == "uncontrolled":
            engine.scheduler.set_num_seqs_cap(args.max_num_seqs)
            runs[kind].append(await drive(plain, kind, args.clients, args.seconds))
            if target_ms is None:  # between batch-1 and saturated p99, from the first uncontrolled run
                saturated = runs[kind][0].window(*settled)[0]
                if not saturated or not batch1.itls:  # e.g. a native kernel built during the run
                    raise SystemExit("p99_controller: no tokens came out in a probe's window; the machine is too "
                                     "busy for these lengths (try --seconds or --target-ms)")
                target_ms = b1_ms + 0.5 * (p99(saturated) * 1e3 - b1_ms)
            continue
        config = ControllerConfig(target_ms / 1e3, args.max_num_seqs, interval_s=args.interval_s,
                                  window_s=10 * args.interval_s)
        live = LiveCap(BatchController(config, time.monotonic()), engine.scheduler, "bench")
        plain.after_step = live.after_step
        runs[kind].append(await drive(plain, kind, args.clients, args.seconds, live))
        plain.after_step = None
    plain.shutdown()
    uncontrolled, controlled = runs["uncontrolled"], runs["controlled"]
    unc_itls = [x for r in uncontrolled for x in r.window(*settled)[0]]
    ctl_itls = [x for r in controlled for x in r.window(*settled)[0]]
    unc_tokens = sum(r.window(*settled)[1] for r in uncontrolled)
    ctl_tokens = sum(r.window(*settled)[1] for r in controlled)
    unc_ms, ctl_ms = p99(unc_itls) * 1e3, p99(ctl_itls) * 1e3
    window_s = 2 * (settled[1] - settled[0])
    if not args.smoke:  # a smoke run's figures mean nothing: the committed plot stays
        plot([uncontrolled[0], controlled[0]], target_ms, args.seconds)
    return {
        "target_ms": round(target_ms, 1), "p99_settled_ms": round(ctl_ms, 1),
        "p99_uncontrolled_ms": round(unc_ms, 1), "throughput_frac": round(ctl_tokens / max(unc_tokens, 1), 3),
        "p99_over_target": round(ctl_ms / target_ms, 3), "batch1_p99_ms": round(b1_ms, 1),
        "uncontrolled_tokens_per_s": round(unc_tokens / window_s, 1),
        "controlled_tokens_per_s": round(ctl_tokens / window_s, 1),
        "settled_caps": [r.caps[-1][1] for r in controlled],
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "dtype": engine.config.dtype,
        "clients": args.clients, "seconds": args.seconds,
        "plot": None if args.smoke else str(PLOT.relative_to(ROOT)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (45 s each)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--target-ms", type=float, default=None, help="p99 ITL target (default: from the probes)")
    parser.add_argument("--seconds", type=float, default=None, help="length of each run (default 90, quick 45)")
    parser.add_argument("--clients", type=int, default=96, help="clients at the top of the ramp (default 96)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128,
                        help="tokens per step at the maximum cap (default 128: two per sequence)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine a second OpenMP thread that waits for "
                             "a busy core makes every step several times slower)")
    parser.add_argument("--interval-s", type=float, default=2.0, help="the controller's interval (default 2)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # short runs, a fixed target (no probe to derive it from), a small engine
        args.seconds, args.clients, args.max_num_seqs, args.max_num_batched_tokens = 2.0, 4, 4, 16
        args.target_ms, args.interval_s = args.target_ms or 1000.0, 1.0
    args.seconds = args.seconds or (45.0 if args.quick else 90.0)
    least = 2 if args.smoke else 20
    if (args.seconds < least or args.clients < 2 or args.max_num_seqs < 1 or args.threads < 1 or not args.interval_s > 0
            or args.max_num_batched_tokens < args.max_num_seqs):
        parser.error("need --seconds >= 20, --clients >= 2, --max-num-seqs >= 1, --threads >= 1, --interval-s > 0, "
                     "--max-num-batched-tokens >= --max-num-seqs")
    if args.target_ms is not None and not args.target_ms > 0:
        parser.error("--target-ms must be positive")
    result = asyncio.run(main_async(args))
    print(f"target {result['target_ms']} ms (batch-1 p99 {result['batch1_p99_ms']} ms); settled p99: "
          f"controlled {result['p99_settled_ms']} ms ({result['p99_over_target']:.2f} x target), uncontrolled "
          f"{result['p99_uncontrolled_ms']} ms; throughput {result['controlled_tokens_per_s']} against "
          f"{result['uncontrolled_tokens_per_s']} tokens/s = {result['throughput_frac']:.3f}; caps settled at "
          f"{result['settled_caps']} of {result['max_num_seqs']}; plot {result['plot']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
