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
"""

from __future__ import annotations

import argparse
import asyncio
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

from bench.common import ensure_model  # noqa: E402
from kvfleet.v1 import inference_pb2_grpc  # noqa: E402
from kvfleet_cli.loadgen.server_side import rss_mib  # noqa: E402

SOAK_MODEL = ROOT / "models" / "soak-tiny"
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
    rss: dict[str, dict[str, tuple[int, float | None]]] = field(default_factory=dict)  # moment → name → (pid, MiB)

    def sample_rss(self, moment: str) -> None:
        procs = {c.name: c.process.pid for c in self.cluster.children()}
        if self.cluster.etcd.process is not None:
            procs["etcd"] = self.cluster.etcd.process.pid
        procs["soak clients"] = os.getpid()
        self.rss[moment] = {name: (pid, rss_mib(pid)) for name, pid in procs.items()}

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
        started = time.monotonic()
        warm_at, end_at = started + args.warmup_minutes * 60, started + args.minutes * 60
        next_fault, fault_index = started + args.fault_every, 0
        load = LoadGenerator(stub, book, MIX, clients=args.clients, seed=args.seed).start()
        try:
            while time.monotonic() < end_at:
                await asyncio.sleep(0.5)
                soak.supervise(expected_down=set())
                if "warm" not in soak.rss and time.monotonic() >= warm_at:
                    soak.sample_rss("warm")
                if soak.faults and time.monotonic() >= next_fault:
                    await soak.inject(soak.faults[fault_index % len(soak.faults)], checker)
                    fault_index += 1
                    next_fault = time.monotonic() + args.fault_every
        finally:
            outcomes = await load.stop()
        soak.supervise(expected_down=set())
        elapsed = time.monotonic() - started
        problems = await checker.check_health() + await checker.check_probe()
        leak = await checker.check_no_leak()
        problems += leak + await checker.check_durability() + violations(outcomes, book.references, soak.policies)
        leaked_blocks, live_sequences = await checker.blocks_in_use()
        soak.sample_rss("end")
    print(summary(args, soak, outcomes, elapsed, problems, leaked_blocks, live_sequences))
    return 1 if problems or soak.deaths else 0


def summary(args, soak: Soak, outcomes, elapsed: float, problems: list[str], leaked: int, live: int) -> str:
    tally = Tally()
    tally.add(outcomes)
    node_deaths = sum(d.startswith("node-") for d in soak.deaths)
    lines = [
        f"soak: {elapsed / 60:.1f} min, {len(soak.cluster.nodes)} nodes, {args.clients} clients, "
        f"faults: {', '.join(soak.faults) or 'none'} (every {args.fault_every:g}s, {len(soak.policies)} injected)",
        f"requests {tally.total}, tokens {tally.tokens} ({tally.tokens / elapsed:.0f}/s); per status: "
        + ", ".join(f"{code} {n}" for code, n in tally.per_status().items()),
        f"restarts {soak.restarts}, node deaths {node_deaths}, process deaths {len(soak.deaths)}; "
        f"leaked blocks {leaked}, live sequences {live}; contract violations {len(problems)}",
        "",
        tally.table(),
        "",
        f"{'process':<14} {'pid':>8} {'start MiB':>10} {'warm MiB':>10} {'end MiB':>10} {'growth':>8}",
    ]
    start, warm, end = (soak.rss.get(m, {}) for m in ("start", "warm", "end"))
    for name in end:
        pid, end_mib = end[name]
        cells = [start.get(name), warm.get(name)]
        base = warm.get(name) if warm.get(name) and warm[name][0] == pid else None
        growth = f"{end_mib - base[1]:+.1f}" if base and base[1] and end_mib else "restarted"

        def mib(cell):
            return f"{cell[1]:.1f}" if cell and cell[1] is not None else "-"

        lines.append(f"{name:<14} {pid:>8} {mib(cells[0]):>10} {mib(cells[1]):>10} {mib(end[name]):>10} {growth:>8}")
    lines.append("(growth: end against after warm-up, same process)")
    lines += [f"death: {d}" for d in soak.deaths] + [f"violation: {p}" for p in problems]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=None, help="default: a quarter of the run, at most 2")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--faults", default="", help=f"comma-separated, in turn: {','.join(FAULTS)}")
    parser.add_argument("--fault-every", type=float, default=300.0, help="seconds between faults")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", default=None, help="logs and state (default: a temporary directory)")
    args = parser.parse_args()
    unknown = [f for f in args.faults.split(",") if f and f not in FAULTS]
    if unknown or args.minutes <= 0 or args.clients < 1:
        parser.error(f"unknown faults {unknown}" if unknown else "--minutes and --clients must be positive")
    if args.warmup_minutes is None:
        args.warmup_minutes = min(2.0, args.minutes / 4)
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="kvfleet-soak-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    cluster = chaos.start_cluster(ensure_model("tiny", SOAK_MODEL), work_dir)
    print(f"cluster up; logs in {work_dir}", flush=True)
    try:
        return asyncio.run(run(args, cluster))
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
