"""A client that leaves while the router asks block_service about its prompt must not cancel that
call: grpc.aio leaks the native memory of a call cancelled in flight (grpc/grpc issue 43360), and
the router's resident memory grew with every such client (issue 35). A real gRPC server and the
router's real lookup and block_service client; the server's MatchPrefix answers when told to."""

from __future__ import annotations

import asyncio
import gc

import grpc
import pytest

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.compute_service.node.mem_probe import malloc_info
from kvfleet.core import run_to_end
from kvfleet.core.membership import NodeInfo, NodeState
from kvfleet.router.nodes import RouterNode
from kvfleet.router.prefix_lookup import BlockServicePrefixLookup
from kvfleet.v1 import block_manager_pb2 as pb
from kvfleet.v1 import block_manager_pb2_grpc as pb_grpc

PROMPT = list(range(64))  # four blocks of 16


class HeldMatch(pb_grpc.BlockManagerServicer):
    """MatchPrefix that waits for ``release`` (None: answers at once), and says how each call ended."""

    def __init__(self, release: asyncio.Event | None = None):
        self.release = release
        self.started = asyncio.Event()
        self.ended: list[str] = []   # "answered" or "cancelled", one per call
        self.finished = asyncio.Event()

    async def MatchPrefix(self, request, context):
        self.started.set()
        try:
            if self.release is not None:
                await self.release.wait()
            self.ended.append("answered")
            return pb.MatchPrefixResponse(nodes=[pb.NodePrefixMatch(node_id="a", num_cached_blocks=2, block_size=16)])
        except asyncio.CancelledError:
            self.ended.append("cancelled")
            raise
        finally:
            self.finished.set()


def node(node_id: str) -> RouterNode:
    return RouterNode(NodeInfo(node_id, "x:1", "m", 64, 16, NodeState.READY), None, None)


async def serving(servicer):
    server = grpc.aio.server()
    pb_grpc.add_BlockManagerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = BlockManagerClient(None, timeout_s=10.0, channel=grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
    return server, client


async def until_no_call_runs() -> None:
    while run_to_end.running():
        await asyncio.sleep(0.01)


def test_a_client_leaving_mid_lookup_leaves_the_call_to_block_service_to_finish():
    async def scenario():
        servicer = HeldMatch(release=asyncio.Event())
        server, client = await serving(servicer)
        lookup = BlockServicePrefixLookup(client)
        try:
            request = asyncio.create_task(lookup.match("t", PROMPT, [node("a"), node("b")]))
            await servicer.started.wait()
            request.cancel()  # the client left while block_service was being asked
            with pytest.raises(asyncio.CancelledError):
                await request
            assert run_to_end.running() == 1  # the call itself goes on
            servicer.release.set()
            await servicer.finished.wait()
            await asyncio.wait_for(until_no_call_runs(), 10)
            assert servicer.ended == ["answered"]  # not cancelled: its batches complete and are freed
        finally:
            await client.close()
            await server.stop(None)

    asyncio.run(scenario())


@pytest.mark.skipif(malloc_info() is None, reason="glibc's mallinfo2 is not available here")
def test_lookups_whose_clients_left_leave_no_native_memory_behind():
    """The consequence, counted: 2,000 lookups each abandoned by its client mid-call. Cancelled in
    flight they left about 900 bytes each in glibc's heap (grpcio 1.85); run to their end, none."""
    n, per_batch = 2000, 50

    async def abandoned(lookup, servicer) -> None:
        servicer.started.clear()
        requests = [asyncio.create_task(lookup.match("t", PROMPT, [node("a"), node("b")])) for _ in range(per_batch)]
        await servicer.started.wait()
        await asyncio.sleep(0)
        for request in requests:
            request.cancel()
        await asyncio.gather(*requests, return_exceptions=True)
        await asyncio.wait_for(until_no_call_runs(), 10)

    async def scenario():
        servicer = HeldMatch()
        server, client = await serving(servicer)
        lookup = BlockServicePrefixLookup(client)
        try:
            for _ in range(300 // per_batch):  # warm-up: the channel's and the allocator's own first growth
                await abandoned(lookup, servicer)
            gc.collect()
            before = malloc_info()["in_use"]
            for _ in range(n // per_batch):
                await abandoned(lookup, servicer)
            gc.collect()
            grown = (malloc_info()["in_use"] - before) * (1 << 20)
        finally:
            await client.close()
            await server.stop(None)
        assert grown < 200 * n, f"glibc's heap grew {grown / n:.0f} bytes per abandoned lookup"
        assert "answered" in servicer.ended

    asyncio.run(scenario())
