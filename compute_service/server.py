"""The node's internal gRPC ``Compute`` service: glue between the routers and ``AsyncEngine``.

``Serve`` is one bidirectional stream per router: a reader task feeds its commands to a
``ServeSession`` while the handler writes the session's batched events; the stream ending (the
router left, or the node finished draining) aborts whatever the router still had running here.
``Stats`` answers the node's load and pool figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from compute_service.async_engine import AsyncEngine
from compute_service.serve_session import ServeSession
from kvfleet.membership import NodeState
from kvfleet.v1 import compute_pb2, compute_pb2_grpc

log = logging.getLogger(__name__)

@dataclass(slots=True)
class NodeStatus:
    """What the servicer shares with the node's lifecycle (main.py)."""

    node_id: str
    state: NodeState = NodeState.WARMING
    num_in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight
    block_rpcs: object = None  # callable returning the allocator's RPC count, when remote
    reconciled: object = None  # callable returning the sequences reconciliation released, when remote

    def __post_init__(self) -> None:
        self.idle.set()


class ComputeServicer(compute_pb2_grpc.ComputeServicer):
    def __init__(self, engine: AsyncEngine, status: NodeStatus, remote=None, stream_interval: int = 1):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}")
        self.engine = engine
        self.status = status
        self.remote = remote  # RemoteAllocatorFactory when blocks come from block_service
        # tokens per chunk (the last chunk may hold fewer): more per message costs inter-token
        # latency and saves the per-message CPU that a small machine takes from the model
        self.stream_interval = stream_interval
        self._sessions: set[ServeSession] = set()

    def request_started(self) -> None:
        self.status.num_in_flight += 1
        self.status.idle.clear()

    def request_ended(self) -> None:
        self.status.num_in_flight -= 1
        if self.status.num_in_flight == 0:
            self.status.idle.set()

    def end_streams(self) -> None:
        """Close every Serve stream (after a drain): their routers see the stream end."""
        for session in list(self._sessions):
            session.close()

    async def Serve(self, request_iterator, context):
        session = ServeSession(self)
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

    async def Stats(self, request, context):
        stats = await self.engine.call(lambda e: e.stats())
        b = stats.blocks
        rpcs = self.status.block_rpcs() if callable(self.status.block_rpcs) else 0
        return compute_pb2.ComputeStats(
            node_id=self.status.node_id, state=self.status.state.value,
            num_running=stats.num_running, num_waiting=stats.num_waiting,
            num_blocks=b.num_blocks, num_free_blocks=b.num_free, num_cached_blocks=b.num_cached,
            num_used_blocks=b.num_used, prefix_queries=b.prefix_queries, prefix_hits=b.prefix_hits,
            generated_tokens=stats.generated_tokens, block_rpcs=rpcs,
            block_size=self.engine.engine.allocator.block_size,
            reconciled_sequences=self.status.reconciled() if callable(self.status.reconciled) else 0,
        )


async def warm_up(engine: AsyncEngine, node_id: str, seed: int = 0) -> float:
    """Touch every kernel path before the node takes traffic (extensions built, caches hot): a
    random-token prefill over several blocks batched with a short one, greedy and sampled decode,
    then a prefill that starts from cached prefix blocks. Returns the seconds it took."""
    import random  # noqa: PLC0415

    from kvfleet.sampling import SamplingParams  # noqa: PLC0415

    started = time.perf_counter()
    e = engine.engine
    rng = random.Random(seed)
    block_size = e.allocator.block_size
    length = min(2 * block_size + 3, e.max_model_len - 8)
    long = [rng.randrange(e.model_config.vocab_size) for _ in range(length)]
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=20, seed=1, ignore_eos=True)

    async def one(name: str, prompt: list[int], sampling: SamplingParams) -> None:
        async for _ in engine.generate(f"warmup-{node_id}-{seed}-{name}", prompt, sampling, tenant="__warmup__"):
            pass

    await asyncio.gather(one("long", long, greedy), one("short", long[:5], sampled))
    await one("cached", long + [1, 2], greedy)  # the long prompt's full blocks are cached now
    return time.perf_counter() - started
