"""The page table at fleet scale: a simulated fleet in one block_service, sized as a user sizing a
fleet would measure it.

``--nodes`` pools (default 1,000) of ``--blocks`` blocks (default 100,000) of 16 tokens. Every node
caches the 32 shared system prompts (64 blocks each) and private suffixes until ~20% of its pool is
cached (``--cached``). Then:

  lookups   1,000 ``match_prefix`` calls of 64–128-block prompts that start with one of the system
            prompts (so every node holds the prefix: the worst case for a scan node by node), half of
            them continuing into one node's private suffix;
  stream    batches as a node sends them — allocate 8 sequences (a system prompt plus 8 fresh
            blocks), commit the fresh blocks, release them — through the durable layer (the log
            written, ``--durability``), counted as block operations (granted, committed, released);
  snapshot  the whole state written as one snapshot (size, seconds);
  recovery  the state rebuilt from that snapshot plus the stream's log (seconds).

In process (default) the fill goes straight into the table (not logged: the snapshot after it holds
it), ``rss_mib`` is this process's resident memory with the fleet loaded and ``bytes_per_block`` its
growth over the process before the table, divided by the fleet's blocks. With ``--grpc`` everything
goes through ``kvfleet block-service`` in its own process (its RSS; lookups include the loopback
round trip; the snapshot is the clean-shutdown one, timed from SIGTERM to exit; recovery is timed
from the restart to the first answered lookup, interpreter start included).

``--json`` prints one object on the last line: ``nodes``, ``blocks_per_node``, ``rss_mib``,
``rss_empty_mib``, ``bytes_per_block``, ``match_prefix_p50_us``, ``match_prefix_p99_us``,
``match_prefix_cpu_p50_us``, ``match_prefix_cpu_p99_us`` (this process's CPU time per lookup: what
a lookup costs when the scheduler does not preempt it; in process only), ``block_ops_per_s``,
``snapshot_mib``, ``snapshot_s``, ``recovery_s``, ``fill_s``, ``peak_rss_mib`` (in process: the most
this process held, the snapshot and the recovery included), and in process ``snapshot_cpu_s``,
``recovery_cpu_s`` (this process's CPU seconds: the wall time on a core of its own),
``recovered_match_prefix_cpu_p50_us`` and ``..._p99_us`` (the same lookups on the recovered table,
the first reads after the recovery: they move the keys they meet out of ``FrozenKeys``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_smoke_flag, peak_rss_mib  # noqa: E402
from kvfleet.block_service.durable import DurablePageTable, recover  # noqa: E402
from kvfleet.cli.loadgen.server_side import rss_mib  # noqa: E402
from kvfleet.cli.ports import free_port  # noqa: E402
from kvfleet.core.allocator import AllocateRequest  # noqa: E402
from kvfleet.core.block_hash import HASH_BYTES  # noqa: E402

BLOCK_SIZE, BYTES_PER_BLOCK = 16, 1 << 17
SYSTEM_PROMPTS, PROMPT_BLOCKS = 32, 64
KEPT_SUFFIX = 64          # blocks of one private suffix per node kept for the lookups
TENANTS = ["acme", "globex", "initech"]
STREAM_SEQS, STREAM_FRESH = 8, 8


class Fleet:
    """The workload, seeded: the same calls in process and over gRPC. ``call(name, *args)`` is the
    page table's method of that name (in process) or the client's (``--grpc``)."""

    def __init__(self, nodes: int, blocks: int, cached: float, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.node_ids = [f"node-{i:04d}" for i in range(nodes)]
        self.blocks = blocks
        self.system = [[self.rng.randbytes(HASH_BYTES) for _ in range(PROMPT_BLOCKS)] for _ in range(SYSTEM_PROMPTS)]
        per_prompt = int(blocks * cached) - SYSTEM_PROMPTS * PROMPT_BLOCKS
        self.suffix_blocks = max(KEPT_SUFFIX, -(-per_prompt // SYSTEM_PROMPTS))
        self.kept: dict[str, list[bytes]] = {}  # node → the start of its suffix after system prompt i % 32
        self.block_ops = 0
        self._seq = 0

    def register(self, call: Callable) -> None:
        for node in self.node_ids:
            call("register_node", node, self.blocks, BLOCK_SIZE, BYTES_PER_BLOCK)

    def fill(self, call: Callable) -> None:
        """Per node, one sequence per system prompt with its own private suffix: allocated,
        committed whole, released (so the blocks stay cached)."""
        for i, node in enumerate(self.node_ids):
            tenant = TENANTS[i % len(TENANTS)]
            reqs = []
            for j, prompt in enumerate(self.system):
                suffix = [self.rng.randbytes(HASH_BYTES) for _ in range(self.suffix_blocks)]
                if j == i % SYSTEM_PROMPTS:
                    self.kept[node] = suffix[:KEPT_SUFFIX]
                hashes = prompt + suffix
                reqs.append(AllocateRequest(node, f"{node}-fill-{j}", tenant, hashes, len(hashes) * BLOCK_SIZE))
            call("allocate_many", reqs)
            call("commit", [(r.seq_id, k, h) for r in reqs for k, h in enumerate(r.block_hashes)])
            call("release", [r.seq_id for r in reqs])

    def lookups(self, count: int) -> list[list[bytes]]:
        prompts = []
        for _ in range(count):
            node = self.rng.choice(self.node_ids)
            length = self.rng.randint(PROMPT_BLOCKS, 2 * PROMPT_BLOCKS)
            own = self.rng.randint(0, length - PROMPT_BLOCKS) if self.rng.random() < 0.5 else 0
            hashes = self.system[int(node[5:]) % SYSTEM_PROMPTS] + self.kept[node][:min(own, KEPT_SUFFIX)]
            prompts.append(hashes + [self.rng.randbytes(HASH_BYTES) for _ in range(length - len(hashes))])
        return prompts

    def batch(self, call: Callable) -> None:
        """One node's batch: allocate, commit the fresh blocks, release."""
        node = self.rng.choice(self.node_ids)
        reqs = []
        for _ in range(STREAM_SEQS):
            self._seq += 1
            hashes = self.rng.choice(self.system) + [self.rng.randbytes(HASH_BYTES) for _ in range(STREAM_FRESH)]
            reqs.append(AllocateRequest(node, f"{node}-s{self._seq}", TENANTS[0], hashes, len(hashes) * BLOCK_SIZE))
        granted = sum(len(a.block_ids) for a in call("allocate_many", reqs))
        commits = [(r.seq_id, k, r.block_hashes[k]) for r in reqs for k in range(PROMPT_BLOCKS, len(r.block_hashes))]
        call("commit", commits)
        call("release", [r.seq_id for r in reqs])
        self.block_ops += 2 * granted + len(commits)


def percentile_us(samples_ns: list[int], q: float) -> float:
    s = sorted(samples_ns)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000


def timed_lookups(call: Callable, prompts: list[list[bytes]]) -> tuple[list[int], list[int]]:
    """Wall and CPU (this thread's) nanoseconds per lookup: on a shared machine a lookup the
    scheduler preempts takes a time slice longer in wall time; its CPU time says what it cost."""
    times, cpu = [], []
    for hashes in prompts:
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        call("match_prefix", hashes)
        cpu.append(time.thread_time_ns() - c)
        times.append(time.perf_counter_ns() - t)
    return times, cpu


def run_stream(fleet: Fleet, call: Callable, batches: int, sync: Callable[[], None]) -> float:
    fleet.block_ops, start = 0, time.perf_counter()
    for _ in range(batches):
        fleet.batch(call)
        sync()
    return fleet.block_ops / (time.perf_counter() - start)


def run_inproc(args, fleet: Fleet, state_dir: str) -> dict:
    gc.collect()
    base = rss_mib(os.getpid())
    store, _ = DurablePageTable.open(state_dir, fsync=args.durability == "fsync")
    table = store.table
    direct = lambda name, *a: getattr(table, name)(*a)  # noqa: E731  (the fill is not logged)
    fleet.register(direct)
    gc.collect()
    empty = rss_mib(os.getpid())
    t = time.perf_counter()
    fleet.fill(direct)
    fill_s = time.perf_counter() - t
    gc.collect()
    full = rss_mib(os.getpid())
    prompts = fleet.lookups(args.lookups)
    times = timed_lookups(direct, prompts)
    t, c = time.perf_counter(), time.process_time()
    path = store.snapshot()
    snapshot_s, snapshot_cpu = time.perf_counter() - t, time.process_time() - c
    logged = lambda name, *a: getattr(store, name)(*a)  # noqa: E731
    ops = run_stream(fleet, logged, args.batches, store.sync)
    expected = [table.match_prefix(h) for h in prompts[:20]]
    del store, table, logged, direct  # a crash: the log is on disk, no clean-shutdown snapshot
    gc.collect()
    t, c = time.perf_counter(), time.process_time()
    recovered, report = recover(state_dir)
    recovery_s, recovery_cpu = time.perf_counter() - t, time.process_time() - c
    assert report.records_applied == 3 * args.batches, report.summary()
    after = timed_lookups(lambda name, *a: getattr(recovered, name)(*a), prompts)  # (the first reads after it)
    assert [recovered.match_prefix(h) for h in prompts[:20]] == expected, "recovered state differs"
    result = figures(args, fleet, full, empty, base, times, ops, os.path.getsize(path), snapshot_s, recovery_s, fill_s)
    result.update(snapshot_cpu_s=round(snapshot_cpu, 2), recovery_cpu_s=round(recovery_cpu, 2),
                  recovered_match_prefix_cpu_p50_us=round(percentile_us(after[1], 0.50), 1),
                  recovered_match_prefix_cpu_p99_us=round(percentile_us(after[1], 0.99), 1))
    return result


def figures(args, fleet: Fleet, full: float, empty: float, base: float, times: tuple[list[int], list[int]], ops: float,
            snap_bytes: int, snapshot_s: float, recovery_s: float, fill_s: float) -> dict:
    total = len(fleet.node_ids) * fleet.blocks
    return {
        "mode": "grpc" if args.grpc else "inproc", "nodes": len(fleet.node_ids), "blocks_per_node": fleet.blocks,
        "cached_fraction": args.cached, "rss_mib": round(full), "rss_empty_mib": round(empty),
        "bytes_per_block": round((full - base) * (1 << 20) / total, 1),
        "bytes_per_block_empty": round((empty - base) * (1 << 20) / total, 1),
        "match_prefix_p50_us": round(percentile_us(times[0], 0.50), 1),
        "match_prefix_p99_us": round(percentile_us(times[0], 0.99), 1),
        "match_prefix_cpu_p50_us": None if args.grpc else round(percentile_us(times[1], 0.50), 1),
        "match_prefix_cpu_p99_us": None if args.grpc else round(percentile_us(times[1], 0.99), 1),
        "block_ops_per_s": round(ops), "snapshot_mib": round(snap_bytes / (1 << 20), 1),
        "snapshot_s": round(snapshot_s, 2), "recovery_s": round(recovery_s, 2), "fill_s": round(fill_s, 1),
        "peak_rss_mib": None if args.grpc else round(peak_rss_mib()),
    }


class Service:
    """``kvfleet block-service`` in its own process and a client on a private event loop."""

    def __init__(self, state_dir: str, durability: str) -> None:
        from kvfleet.block_service.client import BlockManagerClient

        self.address = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(  # plaintext: TLS's cost is bench/cluster_overhead.py --tls's figure
            [sys.executable, "-m", "kvfleet.cli.cli", "--log-level", "ERROR", "block-service", "--listen",
             self.address, "--state-dir", state_dir, "--durability", durability, "--insecure-internal"], cwd=ROOT)
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)  # the client's channel binds to the current loop
        self.client = BlockManagerClient(self.address, timeout_s=600)
        self.loop.run_until_complete(self.client.wait_ready(600))

    def call(self, name: str, *args):
        return self.loop.run_until_complete(getattr(self.client, name)(*args))

    def stop(self) -> float:
        """SIGTERM (the service snapshots), seconds until it exits."""
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
        t = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.perf_counter() - t


def run_grpc(args, fleet: Fleet, state_dir: str) -> dict:
    t = time.perf_counter()
    svc = Service(state_dir, args.durability)
    try:
        base = rss_mib(svc.proc.pid)
        fleet.register(svc.call)
        empty = rss_mib(svc.proc.pid)
        t = time.perf_counter()
        fleet.fill(svc.call)
        fill_s = time.perf_counter() - t
        full = rss_mib(svc.proc.pid)
        prompts = fleet.lookups(args.lookups)
        times = timed_lookups(svc.call, prompts)
        ops = run_stream(fleet, svc.call, args.batches, lambda: None)
        expected = [svc.call("match_prefix", h) for h in prompts[:20]]
    finally:
        snapshot_s = svc.stop()
    snaps = sorted(Path(state_dir).glob("snapshot-*.snap"))
    t = time.perf_counter()
    svc = Service(state_dir, args.durability)
    try:
        got = [svc.call("match_prefix", h) for h in prompts[:20]]
        recovery_s = time.perf_counter() - t
        assert got == expected, "recovered state differs"
    finally:
        svc.stop()
    return figures(args, fleet, full, empty, base, times, ops, snaps[-1].stat().st_size, snapshot_s,
                   recovery_s, fill_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000, help="node pools in the fleet (default 1000)")
    parser.add_argument("--blocks", type=int, default=100_000, help="blocks per node (default 100000)")
    parser.add_argument("--cached", type=float, default=0.2, help="fraction of every pool cached (default 0.2)")
    parser.add_argument("--lookups", type=int, default=1000, help="match_prefix calls timed")
    parser.add_argument("--batches", type=int, default=1000, help="allocate/commit/release batches timed")
    parser.add_argument("--durability", choices=["fsync", "write"], default="fsync")
    parser.add_argument("--grpc", action="store_true", help="through kvfleet block-service in its own process")
    parser.add_argument("--quick", action="store_true", help="100 nodes (CI-sized)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.quick:
        args.nodes = 100
    if args.smoke:
        args.nodes, args.blocks, args.lookups, args.batches = 4, 4 * SYSTEM_PROMPTS * PROMPT_BLOCKS, 20, 20
    if not (args.nodes > 0 and args.blocks >= 4 * SYSTEM_PROMPTS * PROMPT_BLOCKS and 0 < args.cached < 0.9):
        parser.error(f"--nodes must be positive, --blocks at least {4 * SYSTEM_PROMPTS * PROMPT_BLOCKS}, "
                     "--cached between 0 and 0.9")
    fleet = Fleet(args.nodes, args.blocks, args.cached)
    with tempfile.TemporaryDirectory(prefix="kvfleet-fleet-") as state_dir:
        result = (run_grpc if args.grpc else run_inproc)(args, fleet, state_dir)
    if args.json:
        print(json.dumps(result))
        return
    width = max(map(len, result))
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    print(f"goals at 1000 x 100k: rss <= 8192 MiB, match_prefix p99 < 1000 us, snapshot + recovery < 60 s "
          f"(here: {result['snapshot_s'] + result['recovery_s']:.1f} s)")


if __name__ == "__main__":
    main()
