"""The node's internal gRPC ``Compute`` service: glue between the routers and ``AsyncEngine``.

``Serve`` is one bidirectional stream per router: a reader task feeds its commands to a
``ServeSession`` while the handler writes the session's batched events; the stream ending (the
router left, or the node finished draining) aborts whatever the router still had running here.
``Stats`` answers the node's load and pool figures. ``FetchBlocks`` streams KV blocks this node holds
to a peer node (``kv_holder.py``) as frames encoded once by hand (``chunk_wire.py``): ``add_to_server``
registers it to send them as they are; the generated ``add_ComputeServicer_to_server`` makes gRPC
serialize messages, so there the same frames go through protobuf (the same bytes, several copies
slower).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.node.context import NodeContext
from kvfleet.compute_service.node.kv_holder import BlockHolder, InvalidFetch
from kvfleet.compute_service.node.serve_session import ServeSession
from kvfleet.core.tenants import WARMUP_TENANT
from kvfleet.v1 import compute_pb2, compute_pb2_grpc

log = logging.getLogger(__name__)

SERVICE = compute_pb2.DESCRIPTOR.services_by_name["Compute"].full_name


class ComputeServicer(compute_pb2_grpc.ComputeServicer):
    def __init__(self, node: NodeContext):
        self.node = node
        self.holder = BlockHolder(node.engine)
        self._sessions: set[ServeSession] = set()

    def end_streams(self) -> None:
        """Close every Serve stream (after a drain): their routers see the stream end."""
        for session in list(self._sessions):
            session.close()

    async def Serve(self, request_iterator, context):
        session = ServeSession(self.node)
        self._sessions.add(session)
        reader = asyncio.create_task(self._read_commands(request_iterator, session))
        try:
            while (events := await session.next_events()) is not None:
                await context.write(events)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            session.close()
            self._sessions.discard(session)

    @staticmethod
    async def _read_commands(request_iterator, session: ServeSession) -> None:
        try:
            async for commands in request_iterator:
                for command in commands.commands:  # a burst's starts reach the engine together
                    session.command(command)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the stream broke under us
            log.info("Serve stream ended: %s", e)
        session.close()  # the router closed its side: nothing more will be asked

    async def FetchBlocks(self, request, context):
        """Messages, for the generated registration (``add_to_server`` sends the frames instead)."""
        async for data in self.fetch_frames(request, context):
            yield compute_pb2.BlockChunk.FromString(data)

    async def fetch_frames(self, request, context):
        """``FetchBlocks``'s encoded messages (``response_serializer=None``: gRPC sends them as they are)."""
        try:
            async for data in self.holder.serve(request):
                yield data
        except InvalidFetch as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Stats(self, request, context):
        node = self.node
        stats = await node.engine_stats()
        b = stats.blocks
        return compute_pb2.ComputeStats(
            node_id=node.node_id, state=node.state.value,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            num_blocks=b.num_blocks, num_free_blocks=b.num_free, num_cached_blocks=b.num_cached,
            num_used_blocks=b.num_used, prefix_queries=b.prefix_queries, prefix_hits=b.prefix_hits,
            generated_tokens=stats.generated_tokens, block_rpcs=node.block_rpcs(), block_size=node.block_size,
            reconciled_sequences=node.reconciled_sequences(),
        )


def add_to_server(servicer: ComputeServicer, server: grpc.aio.Server) -> None:
    """``Compute`` on ``server``: the generated registration's handlers, but ``FetchBlocks`` answering
    the frames as they are (the same method name: the access table and the guards see no difference)."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    compute_pb2_grpc.add_ComputeServicer_to_server(servicer, _Collect(handlers))
    fetch = handlers["FetchBlocks"]
    handlers["FetchBlocks"] = grpc.unary_stream_rpc_method_handler(
        servicer.fetch_frames, request_deserializer=fetch.request_deserializer, response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


class _Collect:
    """A stand-in server that keeps the generated code's handlers instead of serving them."""

    def __init__(self, into: dict[str, grpc.RpcMethodHandler]) -> None:
        self.into = into

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        assert service == SERVICE, service
        self.into.update(handlers)


async def warm_up(engine: AsyncEngine, node_id: str, *, block_size: int, max_model_len: int, vocab_size: int,
                  seed: int = 0) -> float:
    """Touch every kernel path before the node takes traffic (extensions built, caches hot): a
    random-token prefill over several blocks batched with a short one, greedy and sampled decode,
    then a prefill that starts from cached prefix blocks. Returns the seconds it took."""
    import random

    from kvfleet.core.sampling import SamplingParams

    started = time.perf_counter()
    rng = random.Random(seed)
    length = min(2 * block_size + 3, max_model_len - 8)
    long = [rng.randrange(vocab_size) for _ in range(length)]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, seed=1, ignore_eos=True)

    async def one(name: str, prompt: list[int], sampling: SamplingParams) -> None:
        async for _ in engine.generate(f"warmup-{node_id}-{seed}-{name}", prompt, sampling, tenant=WARMUP_TENANT):
            pass

    await asyncio.gather(one("long", long, greedy), one("short", long[:5], sampled))
    await one("cached", long + [1, 2], greedy)  # the long prompt's full blocks are cached now
    return time.perf_counter() - started
