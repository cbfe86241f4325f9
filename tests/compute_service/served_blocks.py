"""block_service served in-process for the remote allocator's tests, and what they read of it.

The node's two threads are reproduced: an event loop thread (block_service client, early
allocations, flushes) and the calling thread standing in for the engine's step loop. What
block_service holds is read through its own client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import sys
import threading

import grpc

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable, SeqState
from kvfleet.block_service.server import BlockManagerServicer
from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from kvfleet.core.tenants import Tenant
from kvfleet.v1 import block_manager_pb2_grpc

BS, BYTES_PER_BLOCK = 16, 1024


class Served:
    """block_service served in-process on a loop thread of its own, as a node's loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.table = self._fresh_table()
        self.port = 0
        self.server = self.on_loop(self._start())
        self.client = self.on_loop(self._connect())
        self.up = True

    @staticmethod
    def _fresh_table() -> PageTable:
        table = PageTable()
        table.configure_tenants([Tenant("q", quota_mib=4 * BYTES_PER_BLOCK / 2**20)])
        return table

    async def _start(self):
        server = grpc.aio.server()  # on the loop that serves it
        block_manager_pb2_grpc.add_BlockManagerServicer_to_server(
            BlockManagerServicer(DurablePageTable(self.table, None)), server)
        self.port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        await server.start()
        return server

    async def _connect(self) -> BlockManagerClient:
        return BlockManagerClient(f"127.0.0.1:{self.port}")  # its channel belongs to the loop

    def restart(self, keep_state: bool = True) -> None:
        """block_service comes back on the same port: with its state (as after a restart that
        replayed its log) or without (as if it lost it)."""
        self.stop()
        if not keep_state:
            self.table = self._fresh_table()
        self.server = self.on_loop(self._start())
        self.up = True

    def on_loop(self, coro, timeout_s: float = 30.0):
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self._dump_where_it_waits(coro)
            raise

    def _dump_where_it_waits(self, coro) -> None:
        """A call that never ends on the loop leaves its evidence: every task's stack on the loop and
        every thread's, so that a timeout seen once in a long run can be read afterwards."""
        out = sys.stderr
        out.write(f"\n=== on_loop({getattr(coro, '__qualname__', coro)!r}) still waiting: the loop's tasks ===\n")
        dumped = threading.Event()

        def dump_tasks() -> None:
            for task in asyncio.all_tasks(self.loop):
                out.write(f"--- {task!r}\n")
                task.print_stack(file=out)
            dumped.set()

        self.loop.call_soon_threadsafe(dump_tasks)
        dumped.wait(2)
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()

    def stop(self) -> None:
        """block_service goes away (its state with it)."""
        if self.up:
            self.up = False
            self.on_loop(self.server.stop(None))

    def close(self) -> None:
        self.table.check()
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class HeldAsks:
    """block_service's client, whose early allocations a test can hold in flight: ``hold()``,
    then ``in_flight`` is set once an ``AllocateMany`` waits, and ``let_go()`` sends it."""

    def __init__(self, client: BlockManagerClient):
        self.client = client
        self.gate: asyncio.Event | None = None
        self.in_flight = asyncio.Event()

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def hold(self) -> None:
        self.gate = asyncio.Event()
        self.in_flight.clear()

    def let_go(self) -> None:
        self.gate.set()
        self.gate = None

    async def allocate_many(self, requests):
        gate = self.gate
        if gate is not None:
            self.in_flight.set()
            await gate.wait()
        return await self.client.allocate_many(requests)


def hashes(ids, tenant="t"):
    return block_hashes(ids, BS, tenant_extra_key(tenant), max_blocks=(len(ids) - 1) // BS)


def held(on_loop, client, seq_id: str) -> SeqState:
    """What block_service holds for ``seq_id``."""
    [seq] = on_loop(client.sequences([seq_id]))
    return seq


def num_sequences(on_loop, client) -> int:
    nodes, _ = on_loop(client.stats(["n0"]))
    return nodes[0].num_sequences


async def release_on_loop(allocator, seq_id: str) -> None:
    """A request's stream ending: the allocator's release of what the engine never claimed, on the event loop."""
    allocator.release_unclaimed([seq_id])


def check_agrees(allocator, on_loop, client):
    """block_service holds exactly the sequences the allocator knows, with the same blocks
    (handed + reserve) and lengths."""
    live = allocator.live_sequences()
    seqs = on_loop(client.sequences([s.seq_id for s in live])) if live else []
    assert [(s.seq_id, s.tenant, tuple(s.block_ids), s.num_tokens) for s in seqs] == \
        [(s.seq_id, s.tenant, s.block_ids, s.num_tokens) for s in live]
    assert num_sequences(on_loop, client) == len(live)
