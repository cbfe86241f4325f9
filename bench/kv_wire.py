"""KV transfer between nodes (issue 28): the bytes a fetch moves per second, end to end, against a
plain memory copy of the same bytes on the same machine, in the same run.

    child process   the holder: a node's ``Compute`` server under mutual TLS (its own node
                    certificate), its pool filled with N MiB of committed blocks of one tenant's chain
    this process    node n1: ``fetch_blocks`` of that chain into its own pool (channel, handshake,
                    the holder's copy out and checksums, the wire, every check, the write into the
                    pool), timed from the call to its answer; before each fetch, a torch ``copy_``
                    of as many bytes (best of 3), so both see the machine in the same state

Both engines have SmolLM2-135M's dimensions (``models/smollm2-135m-instruct``) and the KV dtype
asked for (``--kv-cache-dtype``, passed to both, never the default); the blocks' bytes are random
(the wire does not look at them). Each repeat first flushes the receiver's pool, so every fetch
moves the whole chain; the best repeat is the figure (``ratio``: best fetch over best copy).

Two more figures say where the time goes: ``tcp_gbps``, the same bytes over a plain loopback TCP
socket (no TLS, no checks: the ceiling of any transfer between two processes here), and
``cpu_s_per_gb``, the CPU seconds each side spent per GB moved in the best fetch (all threads,
gRPC's included): on a busy machine the wall time swings with what else runs, the CPU cost less.

    python bench/kv_wire.py [--mib 256] [--kv-cache-dtype float32] [--block-size 256] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from bench.common import add_smoke_flag
from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.config import EngineConfig
from kvfleet.compute_service.engine.llm_engine import LLMEngine
from kvfleet.compute_service.kv.chain_import import commit_chain, open_chain
from kvfleet.compute_service.kv.pool import bytes_per_block
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.compute_service.node.block_chunks import FetchedBlock
from kvfleet.compute_service.node.kv_fetch import fetch_blocks
from kvfleet.core import certs, tls
from kvfleet.core.allocator import Refusal
from kvfleet.core.block_hash import block_hashes, cluster_seed, tenant_extra_key
from kvfleet.core.identity import Identity

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m-instruct"
HOLDER, RECEIVER, TENANT = "holder", "n1", "bench"


def cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def num_blocks(mib: int, kv_cache_dtype: str, block_size: int) -> tuple[int, int]:
    """(blocks holding at least ``mib`` MiB, bytes of one block)."""
    per = bytes_per_block(ModelConfig.from_dir(MODEL), block_size, kv_cache_dtype)
    return max(1, -(-(mib << 20) // per)), per


def make_engine(mib: int, kv_cache_dtype: str, block_size: int) -> LLMEngine:
    """An engine that only holds KV: its pool is filled and fetched into directly, no step ever runs, so
    its step budget is one block (an engine warms its packed linears up at its budget's rows at load,
    SmolLM2's output head among them)."""
    n, per = num_blocks(mib, kv_cache_dtype, block_size)
    return LLMEngine(MODEL, EngineConfig(dtype="float32", block_size=block_size, kv_cache_memory=(n + 2) * per,
                                         kv_cache_dtype=kv_cache_dtype, preemption_mode="recompute",
                                         max_num_batched_tokens=block_size))


def chain(n: int, block_size: int) -> list[FetchedBlock]:
    """The tenant's chain of ``n`` blocks of seeded tokens, named as the receiver checks them."""
    rng = random.Random(0)
    tokens = [rng.randrange(49152) for _ in range(n * block_size)]
    extra = tenant_extra_key(TENANT)
    hashes = block_hashes(tokens, block_size, extra, cluster_seed())
    return [FetchedBlock(h, hashes[i - 1] if i else b"", tuple(tokens[i * block_size:(i + 1) * block_size]),
                         extra if i == 0 else b"") for i, h in enumerate(hashes)]


def fill(engine: LLMEngine, blocks: list[FetchedBlock]) -> None:
    """Random bytes in the whole pool, then ``blocks`` committed there under the tenant."""
    runner = engine.runner
    runner.kv_cache.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(1))
    if runner.kv_scales is not None:
        runner.kv_scales.uniform_(0.5, 2.0)
    opened = open_chain(engine.allocator, engine.kv.usage, "bench-fill", TENANT, [b.block_hash for b in blocks])
    if isinstance(opened, Refusal):
        raise SystemExit(f"the holder's pool cannot take the chain: {opened.message()}")
    commit_chain(engine.allocator, engine.kv.usage, opened, blocks, len(blocks), lambda fresh, ids: None, TENANT)
    engine.allocator.release(["bench-fill"])


def flush(engine: LLMEngine, n: int) -> None:
    """Take every block of the receiver's pool for hashes nobody holds, and give them back unwritten:
    what a fetch imported is gone, so the next one moves the whole chain again."""
    hashes = [random.randbytes(16) for _ in range(n)]
    opened = open_chain(engine.allocator, engine.kv.usage, "bench-flush", TENANT, hashes)
    if isinstance(opened, Refusal):
        raise SystemExit(f"the receiver's pool cannot be flushed: {opened.message()}")
    engine.allocator.release(["bench-flush"])


def creds(certs_dir: Path, node: str) -> tls.Credentials:
    identity = Identity.node(node)
    return tls.Credentials.load(certs.identity_dir(certs_dir, identity), identity)


async def serve_holder(certs_dir: Path, mib: int, kv_cache_dtype: str, block_size: int) -> None:
    """The child: fill, serve under TLS, print the port, serve until stdin closes."""
    engine = make_engine(mib, kv_cache_dtype, block_size)
    fill(engine, chain(num_blocks(mib, kv_cache_dtype, block_size)[0], block_size))
    async with serving(certs_dir, engine, block_size):
        await asyncio.to_thread(sys.stdin.read)


@contextlib.asynccontextmanager
async def serving(certs_dir: Path, engine: LLMEngine, block_size: int) -> AsyncIterator[AsyncEngine]:
    """``engine`` as node ``holder``'s ``Compute`` server under its certificate, on loopback, its
    port printed (the parent's ``holder_address``); the engine's face, both stopped after."""
    from kvfleet.compute_service.node.context import NodeContext, NodeStatus
    from kvfleet.compute_service.node.server import ComputeServicer, add_to_server
    from kvfleet.core import rpc

    tls.use(creds(certs_dir, HOLDER))
    holder = AsyncEngine(engine)
    server = rpc.server(internal=True)
    add_to_server(ComputeServicer(NodeContext(NodeStatus(HOLDER), holder, block_size)), server)
    port = rpc.bind_internal(server, "127.0.0.1:0")
    await server.start()
    print(json.dumps({"port": port}), flush=True)
    try:
        yield holder
    finally:
        await server.stop(grace=0)
        await asyncio.to_thread(holder.shutdown)


class Memcpy:
    """A plain memory copy of the bytes a fetch moves: a torch ``copy_`` between two touched uint8
    tensors, timed next to each fetch so both see the machine in the same state."""

    def __init__(self, nbytes: int) -> None:
        self.src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # pages touched

    def seconds(self, repeats: int = 3) -> float:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            self.dst.copy_(self.src)
            best = min(best, time.perf_counter() - started)
        return best


def loopback_tcp_gbps(nbytes: int, repeats: int = 3) -> float:
    """A plain TCP socket over loopback moving ``nbytes`` (no TLS, no checks, nothing copied but by
    the kernel): the ceiling any transfer between two processes here starts under."""
    data, into = np.random.randint(0, 256, nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    with socket.create_server(("127.0.0.1", 0)) as server:
        best = float("inf")
        for _ in range(repeats):
            sender = threading.Thread(target=_send_all, args=(server, memoryview(data)))
            sender.start()
            started = time.perf_counter()
            with socket.create_connection(server.getsockname()) as conn:
                got, view = 0, memoryview(into)
                while got < nbytes:
                    got += conn.recv_into(view[got:], nbytes - got)
            best = min(best, time.perf_counter() - started)
            sender.join()
    return nbytes / best / 1e9


def _send_all(server: socket.socket, data: memoryview) -> None:
    conn, _ = server.accept()
    with conn:
        conn.sendall(data)


def cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds of a process so far, all its threads (None: this one)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def fetch_times(address: str, engine: AsyncEngine, blocks: list[FetchedBlock], nbytes: int, repeats: int,
                      holder_pid: int) -> list[tuple]:
    """Per repeat: (the fetch's seconds, the copy's seconds, the holder's CPU seconds in the fetch,
    the receiver's)."""
    hashes = [b.block_hash for b in blocks]
    memcpy = Memcpy(nbytes)
    times = []
    for _ in range(repeats):
        await engine.call(lambda e: flush(e, len(hashes) + 2))
        copy_seconds = memcpy.seconds()
        cpu_before = cpu_seconds(holder_pid), cpu_seconds()
        started = time.perf_counter()
        got = await fetch_blocks(address, HOLDER, TENANT, hashes, engine, deadline_s=600)
        seconds = time.perf_counter() - started
        if got.blocks != len(hashes) or got.held or got.reason is not None or got.bytes != nbytes:
            raise SystemExit(f"the fetch stopped short: {got}")
        times.append((seconds, copy_seconds, cpu_seconds(holder_pid) - cpu_before[0], cpu_seconds() - cpu_before[1]))
    return times


@contextlib.contextmanager
def holder_child(script: str, args: list[str], prefix: str) -> Iterator[tuple[Path, subprocess.Popen]]:
    """``script --serve-holder CERTS *args`` started (the holder, under its own certificate from a
    fresh CA in CERTS): (CERTS, the child), its stdin closed after (it stops serving)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        certs_dir = Path(tmp)
        certs.ensure(certs_dir, [Identity.node(HOLDER), Identity.node(RECEIVER)])
        child = subprocess.Popen([sys.executable, script, "--serve-holder", str(certs_dir), *args],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            yield certs_dir, child
        finally:
            child.stdin.close()
            child.wait(timeout=60)


def holder_address(certs_dir: Path, child: subprocess.Popen) -> str:
    """The holder's address once it serves; this process speaks as node n1 from then on."""
    line = child.stdout.readline()
    if not line:
        raise SystemExit("the holder exited before serving (its stderr is above)")
    tls.use(creds(certs_dir, RECEIVER))
    return f"127.0.0.1:{json.loads(line)['port']}"


def run(mib: int, kv_cache_dtype: str, block_size: int, repeats: int) -> dict:
    with holder_child(__file__, ["--mib", str(mib), "--kv-cache-dtype", kv_cache_dtype, "--block-size",
                                 str(block_size)], "kv-wire-") as (certs_dir, child):
        receiver = make_engine(mib, kv_cache_dtype, block_size)
        address = holder_address(certs_dir, child)
        engine = AsyncEngine(receiver)
        try:
            n, per = num_blocks(mib, kv_cache_dtype, block_size)
            blocks = chain(n, block_size)
            times = asyncio.run(fetch_times(address, engine, blocks, n * per, repeats, child.pid))
        finally:
            engine.shutdown()
    moved = n * per
    seconds, _, holder_cpu, receiver_cpu = min(times)
    transfer, memcpy = moved / seconds / 1e9, moved / min(t[1] for t in times) / 1e9
    return dict(transfer_gbps=round(transfer, 3), memcpy_gbps=round(memcpy, 3), ratio=round(transfer / memcpy, 4),
                tcp_gbps=round(loopback_tcp_gbps(moved), 3),
                cpu_s_per_gb=dict(holder=round(holder_cpu / moved * 1e9, 2), receiver=round(receiver_cpu / moved * 1e9, 2)),
                mib=round(moved / (1 << 20), 1), blocks=len(blocks), block_size=block_size,
                kv_cache_dtype=kv_cache_dtype, seconds=[round(t[0], 4) for t in times],
                memcpy_seconds=[round(t[1], 4) for t in times], cpu=cpu(),
                cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB of KV blocks to move")
    parser.add_argument("--kv-cache-dtype", default="float32", choices=["float32", "bfloat16", "float16", "fp8_e4m3"])
    parser.add_argument("--block-size", type=int, default=256, help="tokens per block (the node's default: 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    parser.add_argument("--serve-holder", type=Path, metavar="CERTS", help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:  # a few blocks of 16 tokens, once
        args.mib, args.block_size, args.repeats = 4, 16, 1
    logging.basicConfig(level=logging.WARNING)
    if args.serve_holder is not None:
        asyncio.run(serve_holder(args.serve_holder, args.mib, args.kv_cache_dtype, args.block_size))
        return
    result = run(args.mib, args.kv_cache_dtype, args.block_size, args.repeats)
    if not args.json:
        print(f"KV fetch of {result['mib']} MiB ({result['blocks']} blocks of {args.block_size} tokens, "
              f"{args.kv_cache_dtype}) over mutual TLS: {result['transfer_gbps']} GB/s; memory copy "
              f"{result['memcpy_gbps']} GB/s; ratio {result['ratio']:.1%}; plain loopback TCP "
              f"{result['tcp_gbps']} GB/s; CPU s/GB {result['cpu_s_per_gb']} on {result['cpu']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
