"""What a compute node's Serve streams may use of the node, and nothing else.

``lifecycle.py`` builds one ``NodeContext`` once the engine is up; the Compute servicer hands it to every
Serve stream (``ServeSession``) and every request on one (``RequestStream``). They reach the node
only through its methods, so what a stream can do to the node is written here, in one place:

    NodeContext
      status        NodeStatus: node id, lifecycle state, in-flight count (lifecycle.py drains on it)
      engine        AsyncEngine: requests in, outputs back, aborts
      early_blocks  EarlyBlocks when blocks come from block_service (None: an in-process pool)
      prefix_fetch  the peer fetch at admission (prefix_fetch.py; None: no peers to fetch from)
      block_size, stream_interval
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.request_output import RequestOutput
from kvfleet.compute_service.engine.stats import EngineStats
from kvfleet.compute_service.node.prefix_fetch import PrefixFetcher
from kvfleet.core.membership import NodeState
from kvfleet.core.roles import MIXED
from kvfleet.core.sampling import SamplingParams


@dataclass(slots=True)
class NodeStatus:
    """What the node's lifecycle (lifecycle.py) and its streams share: the state it moves on,
    the in-flight count the streams keep and a drain waits on."""

    node_id: str
    state: NodeState = NodeState.WARMING
    role: str = MIXED  # kvfleet.core.roles
    num_in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight
    block_rpcs: Callable[[], int] = lambda: 0  # the allocator's RPC count (0 for an in-process pool)
    reconciled: Callable[[], int] = lambda: 0  # sequences reconciliation released at block_service
    block_sync_calls: Callable[[], dict[str, int]] = dict  # block_service calls a step waited on, by call

    def __post_init__(self) -> None:
        self.idle.set()

    def request_started(self) -> None:
        self.num_in_flight += 1
        self.idle.clear()

    def request_ended(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self.idle.set()


@dataclass(slots=True)
class EarlyBlocks:
    """block_service's side of a request: its prompt's blocks are asked for when it arrives, so
    the engine's step does not wait on the network when the scheduler admits it; they are given
    back if it ends before the scheduler claimed them. block_service calls made for a request
    join its trace, through ``trace_contexts`` (read by the remote allocator)."""

    preallocate: Callable[..., Awaitable[None]]                    # (seq id, tenant, token ids, prefix group)
    release_blocks: Callable[[list[str]], None]                    # the allocator's release (seq ids)
    trace_contexts: dict[str, object]                              # seq id → OpenTelemetry context

    async def allocate(self, seq_id: str, tenant: str, token_ids: list[int], trace_context: object,
                       prefix_group: str = "") -> None:
        self.trace_contexts[seq_id] = trace_context
        await self.preallocate(seq_id, tenant, token_ids, prefix_group)

    def release(self, seq_id: str) -> None:
        self.trace_contexts.pop(seq_id, None)
        self.release_blocks([seq_id])


@dataclass(slots=True)
class NodeContext:
    status: NodeStatus
    engine: AsyncEngine
    block_size: int                    # tokens per KV block (reported in Stats)
    # tokens per chunk (the last chunk may hold fewer): more per message costs inter-token latency
    # and saves the per-message CPU that a small machine takes from the model
    stream_interval: int = 1
    early_blocks: EarlyBlocks | None = None
    prefix_fetch: PrefixFetcher | None = None

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")

    @property
    def node_id(self) -> str:
        return self.status.node_id

    @property
    def state(self) -> NodeState:
        return self.status.state

    def request_started(self) -> None:
        self.status.request_started()

    def request_ended(self) -> None:
        self.status.request_ended()

    def block_rpcs(self) -> int:
        return self.status.block_rpcs()

    def reconciled_sequences(self) -> int:
        return self.status.reconciled()

    def check_prompt(self, prompt: list[int], generated: list[int]) -> None:
        """``ValueError`` if the engine would refuse this prompt: checked before any block is asked for."""
        self.engine.check_prompt(prompt, generated)

    async def fetch_prefix(self, tenant: str, token_ids: list[int], source: str = "", prefix_group: str = "") -> None:
        """Bring the prompt's cached prefix from the peer that holds it, when that beats a prefill
        (from ``source``, the prefill node of a hand-over, when given)."""
        if self.prefix_fetch is not None:
            await self.prefix_fetch.before_admission(tenant, token_ids, source, prefix_group)

    async def allocate_early(self, request_id: str, tenant: str, token_ids: list[int], trace_context: object,
                             prefix_group: str = "") -> None:
        """Ask block_service for the request's blocks now (a no-op with an in-process pool)."""
        if self.early_blocks is not None:
            await self.early_blocks.allocate(request_id, tenant, token_ids, trace_context, prefix_group)

    def release_early(self, request_id: str) -> None:
        """The request ended: blocks the scheduler never claimed go back (a no-op in-process)."""
        if self.early_blocks is not None:
            self.early_blocks.release(request_id)

    async def submit(self, request_id: str, prompt: list[int], generated: list[int], sampling: SamplingParams,
                     on_output: Callable[[RequestOutput], None], tenant: str, priority: int,
                     arrival_s: float | None = None, prefix_group: str = "") -> None:
        """Hand the request to the engine (``generated``: output a failed node already delivered;
        ``arrival_s``: when it reached the node; ``prefix_group``: the group salting its chain);
        bad input raises ``ValueError``."""
        await self.engine.submit(request_id, prompt, sampling, on_output, tenant, priority, generated, arrival_s,
                                 prefix_group)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def engine_stats(self) -> EngineStats:
        return await self.engine.call(lambda engine: engine.stats())
