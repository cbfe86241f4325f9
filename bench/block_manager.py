"""Block manager operations per second: the page table in-process against the same trace through
block_service over loopback gRPC, with the write-ahead log off and fsynced.

The trace (``kvfleet.block_service.trace``): prompts that share a few long prefixes plus a private part, every
live sequence growing by one block (``block_size`` tokens) per step, full blocks committed, finished
sequences released, new ones arriving; pools small enough that eviction and refusals happen. A block
operation is one block granted (prefix hits included), appended, committed or released.

  (a) inproc        — ``PageTable`` calls in this process
  (b) inproc_fsync  — the durable layer, one group commit (write + fsync) per trace step
  (c) grpc          — ``kvfleet block-service --durability off`` in its own process (plaintext), CLIENTS traces
                      concurrently, each step a few batched RPCs
  (d) grpc_fsync    — the same with the log fsynced before every answer (the default)

Prints ops/s of each and the ratios against (a). ``--json`` prints one object with
``inproc_ops_per_s``, ``inproc_fsync_ops_per_s``, ``grpc_ops_per_s``, ``grpc_fsync_ops_per_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import add_smoke_flag  # noqa: E402
from kvfleet.block_service.client import BlockManagerClient  # noqa: E402
from kvfleet.block_service.durable import DurablePageTable  # noqa: E402
from kvfleet.block_service.page_table import PageTable  # noqa: E402
from kvfleet.block_service.trace import Trace, drive, drive_async  # noqa: E402
from kvfleet.cli.ports import free_port  # noqa: E402

NODES = [f"n{i}" for i in range(4)]
TENANTS = ["acme", "globex", "initech"]
NUM_BLOCKS, BLOCK_SIZE, BYTES_PER_BLOCK = 16384, 16, 1 << 17
WARMUP_STEPS = 40  # a trace reaches its steady state (pools full, as many releases as arrivals)


def make_trace(seed: int, arrivals: int, name: str = "s") -> Trace:
    return Trace(seed=seed, node_ids=NODES, tenants=TENANTS, block_size=BLOCK_SIZE, num_prefixes=16,
                 prefix_blocks=32, private_tokens=(1, 512), output_tokens=(16, 512),
                 arrivals_per_step=arrivals, name=name)


def register(table) -> None:
    for node in NODES:
        table.register_node(node, NUM_BLOCKS, BLOCK_SIZE, BYTES_PER_BLOCK)


def bench_inproc(seconds: float, durable_dir: str | None, warmup: int = WARMUP_STEPS) -> float:
    if durable_dir:
        target, _ = DurablePageTable.open(durable_dir)
        sync = target.sync
    else:
        target, sync = PageTable(), (lambda: None)
    register(target)
    trace = make_trace(0, arrivals=64)
    for _ in range(warmup):
        drive(target, trace.step())
        sync()
    start_ops, start = trace.block_ops, time.perf_counter()
    while time.perf_counter() - start < seconds:
        drive(target, trace.step())
        sync()
    rate = (trace.block_ops - start_ops) / (time.perf_counter() - start)
    if durable_dir:
        target.close()
    return rate



async def _drive_service(address: str, seconds: float, clients: int, arrivals: int, warmup: int) -> float:
    async with BlockManagerClient(address) as client:
        await client.wait_ready(30)
        for node in NODES:
            await client.register_node(node, NUM_BLOCKS, BLOCK_SIZE, BYTES_PER_BLOCK)
        traces = [make_trace(seed, arrivals, name=f"c{seed}-") for seed in range(clients)]

        async def run(trace: Trace, steps: int | None, until: float | None) -> None:
            n = 0
            while (steps is not None and n < steps) or (until is not None and time.perf_counter() < until):
                await drive_async(client, trace.step())
                n += 1

        await asyncio.gather(*(run(t, warmup, None) for t in traces))
        start_ops, start = sum(t.block_ops for t in traces), time.perf_counter()
        await asyncio.gather(*(run(t, None, start + seconds) for t in traces))
        return (sum(t.block_ops for t in traces) - start_ops) / (time.perf_counter() - start)


def bench_grpc(seconds: float, durability: str, clients: int, arrivals: int, warmup: int = WARMUP_STEPS) -> float:
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as state_dir:
        proc = subprocess.Popen(  # plaintext: TLS's cost is bench/cluster_overhead.py --tls's figure
            [sys.executable, "-m", "kvfleet.cli.cli", "--log-level", "ERROR", "block-service", "--listen", address,
             "--state-dir", state_dir, "--durability", durability, "--insecure-internal"],
            cwd=ROOT,
        )
        try:
            return asyncio.run(_drive_service(address, seconds, clients, arrivals, warmup))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs (under a minute in all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with the figures")
    parser.add_argument("--clients", type=int, default=4, help="concurrent traces against the service")
    parser.add_argument("--arrivals", type=int, default=64, help="new sequences per trace step")
    add_smoke_flag(parser)
    args = parser.parse_args()
    seconds = 0.2 if args.smoke else 3.0 if args.quick else 15.0
    warmup = 2 if args.smoke else WARMUP_STEPS
    clients, arrivals = (1, 8) if args.smoke else (args.clients, args.arrivals)
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-") as d:
        figures = {
            "inproc_ops_per_s": bench_inproc(seconds, None, warmup),
            "inproc_fsync_ops_per_s": bench_inproc(seconds, d, warmup),
        }
    figures["grpc_ops_per_s"] = bench_grpc(seconds, "off", clients, arrivals, warmup)
    figures["grpc_fsync_ops_per_s"] = bench_grpc(seconds, "fsync", clients, arrivals, warmup)
    if args.json:
        print(json.dumps({k: round(v) for k, v in figures.items()}))
        return
    base = figures["inproc_ops_per_s"]
    print(f"{'mode':<22}{'block ops/s':>14}{'vs in-process':>16}")
    for name, value in figures.items():
        print(f"{name.removesuffix('_ops_per_s'):<22}{value:>14,.0f}{value / base:>15.3f}x")
    print("targets: inproc >= 500,000/s, grpc_fsync >= 50,000/s")


if __name__ == "__main__":
    main()
