"""A long run of mixed tenants with cancellations, and faults on a schedule if asked: does anything
die, leak, grow or break its contract?

    python bench/soak.py [--minutes 30] [--faults block_service,node,router,etcd,etcd-freeze]
                         [--fault-every 300] [--clients 6] [--warmup-minutes 2]

A local cluster (the chaos suite's: tiny model, blocks of 16, tenants gold, free and a small one of
1 MiB) serves clients that send greedy streams, cancel early (5-80 ms) and late (mid-stream), and
flood the small tenant's quota. A process that dies unasked is counted and started again, as a
supervisor would. At the end, after the requests have settled: the chaos suite's checks (health, a
token-exact probe, leaked blocks and sequences, block_service's durable invariants, every client's
status and tokens), and one table: requests, outcomes per status, faults, restarts, deaths, leaked
blocks, resident memory (VmRSS) per process at start, after warm-up and at the end.

Resident memory is sampled every ``--rss-interval-s`` all along, and each process's growth after
warm-up is one figure, ``rss_slope_mib_per_hour``: a least-squares line through its samples
(``kvfleet/cli/loadgen/rss_slope.py``; issue 35's goal: 5 MiB an hour or less). The nodes also write
their glibc heap figures (the memory probe's cheap half, ``KVFLEET_MEM_PROBE``), fitted the same way:
``in_use`` rising is memory something holds, ``free`` rising with ``in_use`` flat is fragmentation.
``--json`` prints all of it as one JSON object on the last line; ``--quick`` is a 3-minute shape
(1 minute of warm-up, a sample every 5 s) that checks the whole path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "chaos")]

import chaos_cluster as chaos  # noqa: E402
import grpc  # noqa: E402
from chaos_checker import ClusterChecker, last_errors  # noqa: E402
from chaos_load import LoadGenerator, PromptBook  # noqa: E402
from chaos_outcomes import FaultPolicy, RequestSpec, Tally, violations  # noqa: E402

from bench.common import add_smoke_flag, ensure_model  # noqa: E402
from kvfleet.cli.bench_command import cpu_model  # noqa: E402
from kvfleet.cli.loadgen.memory_track import MemoryTrack, heap_slopes, probe_dir, probe_env  # noqa: E402
from kvfleet.v1 import inference_pb2_grpc  # noqa: E402

SOAK_MODEL = ROOT / "models" / "soak-tiny"
GOAL_MIB_PER_HOUR = 5.0  # issue 35: resident memory growth after warm-up, per process
PROMPTS = {
    **{f"p{i}": (n, 160) for i, n in enumerate((17, 40, 75, 110, 150))},
    **{f"f{i}": (n, 200) for i, n in enumerate((120, 170, 230))},  # the small tenant's: each fits its quota
}
MIX = (
    [RequestSpec("stream", key, f"p{i}", n) for key in ("sk-gold", "sk-free") for i in range(5) for n in (32, 160)]
    + [RequestSpec("early-cancel", key, f"p{i}", 160, cancel_after_s=ms / 1000)
       for key in ("sk-gold", "sk-small") for i in range(5) for ms in (5, 20, 40, 80)]
    + [RequestSpec("late-cancel", "sk-free", f"p{i}", 160, cancel_after_tokens=n) for i in range(5) for n in (1, 30)]
    + [RequestSpec("flood", "sk-small", f"f{i}", 200) for i in range(3)] * 4
)
FAULTS = {  # name → (what is done, its policy, the process it restarts)
    "block_service": (lambda c: chaos.kill_and_restart(c, "block_service"), chaos.BLOCK_SERVICE_DOWN, "block_service"),
    "node": (lambda c: chaos.kill_and_restart(c, "node-0"), chaos.NODE_DOWN, "node-0"),
    "router": (lambda c: chaos.kill_and_restart(c, "router"), chaos.ROUTER_DOWN, "router"),
    "etcd": (chaos.restart_etcd, chaos.ETCD_DOWN, "etcd"),
    "etcd-freeze": (chaos.freeze_etcd, chaos.ETCD_DOWN, None),
}


@dataclass(slots=True)
class Soak:
    cluster: object
    faults: list[str]
    fault_every_s: float
    policies: list[FaultPolicy] = field(default_factory=list)
    deaths: list[str] = field(default_factory=list)       # "name (exit N): last error"
    restarts: int = 0                                      # scheduled and supervised
    started: float = 0.0                                   # time.monotonic() at the start sample
    memory: MemoryTrack = field(default_factory=MemoryTrack)

    def sample_rss(self, moment: str | None = None) -> None:
        procs = {c.name: c.process.pid for c in self.cluster.children()}
        if self.cluster.etcd.process is not None:
            procs["etcd"] = self.cluster.etcd.process.pid
        procs["soak clients"] = os.getpid()
        self.started = self.started or time.monotonic()
        self.memory.sample(procs, time.monotonic() - self.started, moment)

    def heap(self, warmup_s: float, started_wall: float) -> dict[str, dict]:
        """Each node's heap slopes from its probe file (its last process's), where it wrote one."""
        directory, out = probe_dir(), {}
        for name, samples in self.memory.series.items():
            path = directory / f"mem-{name}-{samples[-1][1]}.jsonl" if directory else None
            if path and name.startswith("node-") and path.exists():
                out[name] = heap_slopes(path, started_wall, warmup_s)
        return out

    def supervise(self, expected_down: set[str]) -> None:
        """Count and restart a process that died unasked (on the loop's thread: see chaos_cluster)."""
        for name, code in self.cluster.exited().items():
            if name in expected_down:
                continue
            error = last_errors(self.cluster.child(name).log_tail(200), 1) if name != "etcd" else ""
            self.deaths.append(f"{name} (exit {code}): {error}")
            print(f"[{time.strftime('%H:%M:%S')}] {name} died: {error}; restarting", flush=True)
            self.cluster.restart(name)
            self.restarts += 1

    async def inject(self, name: str, checker: ClusterChecker) -> None:
        action, policy, child = FAULTS[name]
        print(f"[{time.strftime('%H:%M:%S')}] fault: {name}", flush=True)
        start = time.monotonic()
        await action(self.cluster)
        self.restarts += child is not None
        await checker.check_health()  # its window ends when every part serves again
        self.policies.append(policy.within(start, time.monotonic()))


async def run(args: argparse.Namespace, cluster) -> int:
    book = PromptBook.seeded({name: n for name, (n, _) in PROMPTS.items()}, seed=5)
    soak = Soak(cluster, [f for f in args.faults.split(",") if f], args.fault_every)
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await book.record_references(stub, "sk-gold", {name: m for name, (_, m) in PROMPTS.items()})
        checker = ClusterChecker(cluster, book)
        await checker.baseline()
        soak.sample_rss("start")
        started, started_wall = time.monotonic(), time.time()
        warm_at, end_at = started + args.warmup_minutes * 60, started + args.minutes * 60
        next_rss = started + args.rss_interval_s
        next_fault, fault_index = started + args.fault_every, 0
        load = LoadGenerator(stub, book, MIX, clients=args.clients, seed=args.seed).start()
        try:
            while time.monotonic() < end_at:
                await asyncio.sleep(0.5)
                soak.supervise(expected_down=set())
                warming = "warm" not in soak.memory.moments and time.monotonic() >= warm_at
                if warming or time.monotonic() >= next_rss:
                    soak.sample_rss("warm" if warming else None)
                    next_rss = time.monotonic() + args.rss_interval_s
                if soak.faults and time.monotonic() >= next_fault:
                    await soak.inject(soak.faults[fault_index % len(soak.faults)], checker)
                    fault_index += 1
                    next_fault = time.monotonic() + args.fault_every
        finally:
            outcomes = await load.stop()
        soak.supervise(expected_down=set())
        elapsed = time.monotonic() - started
        # tokens are compared with the references only in float32, where a stream's tokens do not depend
        # on what else shares its batch; in bfloat16 they may (rounding), so only statuses are checked
        exact = tokens_checked(soak)
        problems = await checker.check_health() + (await checker.check_probe() if exact else [])
        leak = await checker.check_no_leak()
        problems += leak + await checker.check_durability() + violations(outcomes, book.references if exact else {},
                                                                         soak.policies)
        leaked_blocks, live_sequences = await checker.blocks_in_use()
        soak.sample_rss("end")
    heap = soak.heap(args.warmup_minutes * 60, started_wall)
    if args.json:
        print(json.dumps(report(args, soak, outcomes, elapsed, problems, leaked_blocks, live_sequences, heap)))
    else:
        print(summary(args, soak, outcomes, elapsed, problems, leaked_blocks, live_sequences, heap))
    return 1 if problems or soak.deaths else 0


def tokens_checked(soak: Soak) -> bool:
    return soak.cluster.node.engine.dtype == "float32"


def counts(soak: Soak, outcomes, elapsed: float, problems: list[str], leaked: int, live: int) -> tuple[Tally, dict]:
    tally = Tally()
    tally.add(outcomes)
    return tally, dict(
        dtype=soak.cluster.node.engine.dtype, minutes=round(elapsed / 60, 2), nodes=len(soak.cluster.nodes),
        tokens_checked=tokens_checked(soak), requests=tally.total, tokens=tally.tokens,
        tokens_per_s=round(tally.tokens / elapsed, 1), per_status=dict(tally.per_status()), restarts=soak.restarts,
        node_deaths=sum(d.startswith("node-") for d in soak.deaths), process_deaths=len(soak.deaths),
        faults_injected=len(soak.policies), leaked_blocks=leaked, live_sequences=live, violations=len(problems))


def summary(args, soak: Soak, outcomes, elapsed: float, problems: list[str], leaked: int, live: int, heap) -> str:
    tally, c = counts(soak, outcomes, elapsed, problems, leaked, live)
    worst = soak.memory.worst(args.warmup_minutes * 60)
    lines = [
        f"soak: {c['minutes']:.1f} min, {c['nodes']} nodes, {args.clients} clients, {cpu_model()}, {c['dtype']}; "
        f"faults: {', '.join(soak.faults) or 'none'} (every {args.fault_every:g}s, {c['faults_injected']} injected)",
        f"requests {c['requests']}, tokens {c['tokens']} ({c['tokens_per_s']:.0f}/s); per status: "
        + ", ".join(f"{code} {n}" for code, n in c["per_status"].items()),
        f"restarts {c['restarts']}, node deaths {c['node_deaths']}, process deaths {c['process_deaths']}; "
        f"leaked blocks {leaked}, live sequences {live}; contract violations {len(problems)}",
        "steepest memory growth after warm-up: " + (
            f"{worst['process']} {worst['rss_slope_mib_per_hour']:+.1f} MiB/h (goal: {GOAL_MIB_PER_HOUR:g} or less)"
            if worst else "none fitted (too few samples after the warm-up)"),
        "",
        tally.table(),
        "",
        *soak.memory.table(args.warmup_minutes * 60, heap),
    ]
    lines += [f"death: {d}" for d in soak.deaths] + [f"violation: {p}" for p in problems]
    return "\n".join(lines)


def report(args, soak: Soak, outcomes, elapsed: float, problems: list[str], leaked: int, live: int, heap) -> dict:
    """--json: the run's settings and counts, the steepest slope, and every process's memory."""
    _, c = counts(soak, outcomes, elapsed, problems, leaked, live)
    warmup_s = args.warmup_minutes * 60
    return dict(
        cpu=cpu_model(), clients=args.clients, faults=soak.faults, warmup_minutes=args.warmup_minutes,
        rss_interval_s=args.rss_interval_s, goal_mib_per_hour=GOAL_MIB_PER_HOUR, **c,
        worst_rss_slope=soak.memory.worst(warmup_s), deaths=soak.deaths, problems=problems,
        processes=soak.memory.report(warmup_s, heap))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=None, help="default 30 (--quick: 3)")
    parser.add_argument("--warmup-minutes", type=float, default=None, help="default: a quarter of the run, at most 2")
    parser.add_argument("--rss-interval-s", type=float, default=None, help="seconds between memory samples (30; --quick: 5)")
    parser.add_argument("--quick", action="store_true", help="3 minutes, 1 of warm-up, memory every 5 s")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--faults", default="", help=f"comma-separated, in turn: {','.join(FAULTS)}")
    parser.add_argument("--fault-every", type=float, default=300.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], default="float32",
                        help="the nodes' compute dtype (auto: the engine's default here); default float32")
    parser.add_argument("--work-dir", default=None, help="logs and state (default: a temporary directory)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # 6 s, 1 of warm-up, memory every second
        args.minutes, args.warmup_minutes, args.rss_interval_s, args.clients = 1 / 10, 1 / 60, 1.0, 2
    for name, full, quick in (("minutes", 30.0, 3.0), ("rss_interval_s", 30.0, 5.0), ("warmup_minutes", None, 1.0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    unknown = [f for f in args.faults.split(",") if f and f not in FAULTS]
    if unknown or args.minutes <= 0 or args.clients < 1 or args.rss_interval_s <= 0:
        parser.error(f"unknown faults {unknown}" if unknown else "--minutes, --clients and --rss-interval-s must be positive")
    if args.warmup_minutes is None:
        args.warmup_minutes = min(2.0, args.minutes / 4)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="kvfleet-soak-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(probe_env(work_dir / "mem", args.rss_interval_s))  # the nodes inherit it
    cluster = chaos.start_cluster(ensure_model("tiny", SOAK_MODEL), work_dir, dtype=args.dtype)
    print(f"cluster up; logs in {work_dir}", flush=True)
    try:
        return asyncio.run(run(args, cluster))
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
