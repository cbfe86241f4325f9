"""The node's internal gRPC ``Compute`` service: glue between the router and ``AsyncEngine``.

protobuf → ``SamplingParams`` and token ids → ``AsyncEngine.generate`` → ``ComputeChunk``. Each
request gets a ``prefill`` span (until its first token) and a ``decode`` span (the rest) under the
server span that the gRPC instrumentation opened from the router's trace context.

A block refusal (the engine aborts a request whose blocks were refused) is RESOURCE_EXHAUSTED with
trailing metadata ``kvfleet-refusal: quota|pool``: a quota is the tenant's problem, a full pool
is this node's, and the router retries a full pool elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from opentelemetry import trace

from compute_service.async_engine import AsyncEngine
from compute_service.tokenizer import IncrementalDetokenizer
from kvfleet.membership import NodeState
from kvfleet.v1 import compute_pb2, compute_pb2_grpc, inference_pb2
from kvfleet.wire import REFUSAL_KEY, InvalidRequest, sampling_from_proto

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

FINISH = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "abort": inference_pb2.FINISH_REASON_ABORT,
}
MAX_ID_LEN = 128
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # the router pings every 20 s
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass(slots=True)
class NodeStatus:
    """What the servicer shares with the node's lifecycle (main.py)."""

    node_id: str
    state: NodeState = NodeState.WARMING
    num_in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while nothing is in flight
    block_rpcs: object = None  # callable returning the allocator's RPC count, when remote

    def __post_init__(self) -> None:
        self.idle.set()


def _resumed_detokenizer(tokenizer, resumed: list[int]) -> IncrementalDetokenizer:
    """A detokenizer that has already seen ``resumed``, so the first new token's text is decoded in
    context (a leading space or a multi-byte character split across nodes comes out right)."""
    detok = IncrementalDetokenizer(tokenizer)
    detok.ids = list(resumed)
    detok.prefix_offset = max(len(resumed) - 6, 0)
    detok.read_offset = len(resumed)
    return detok


def _check(request) -> list[int]:
    if not request.request_id or len(request.request_id) > MAX_ID_LEN:
        raise InvalidRequest(f"request_id must be 1..{MAX_ID_LEN} characters")
    if not request.tenant:
        raise InvalidRequest("tenant is missing")
    ids = list(request.prompt_token_ids)
    if not ids:
        raise InvalidRequest("prompt_token_ids is empty")
    if request.num_resumed_tokens >= len(ids):
        raise InvalidRequest("num_resumed_tokens must be smaller than the number of prompt tokens")
    return ids


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

    async def Generate(self, request, context):
        if self.status.state != NodeState.READY:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"node {self.status.node_id} is {self.status.state.value}, not taking requests")
        try:
            ids = _check(request)
            sampling = sampling_from_proto(request.sampling)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        span = trace.get_current_span()
        span.set_attributes({"kvfleet.node_id": self.status.node_id, "kvfleet.tenant": request.tenant,
                             "kvfleet.prompt_tokens": len(ids), "kvfleet.resumed_tokens": request.num_resumed_tokens})
        resumed = ids[len(ids) - request.num_resumed_tokens:] if request.num_resumed_tokens else []
        detok = _resumed_detokenizer(self.engine.engine.tokenizer, resumed) if resumed else None
        self.status.num_in_flight += 1
        self.status.idle.clear()
        outputs = self.engine.generate(request.request_id, ids, sampling, request.tenant, request.priority)
        phase = tracer.start_span("prefill")
        completion = 0
        try:
            if self.remote is not None:
                # block_service calls for this request join its trace, under the prefill span
                self.remote.trace_contexts[request.request_id] = trace.set_span_in_context(phase)
                with trace.use_span(phase):
                    await self.remote.allocator.preallocate(
                        request.request_id, request.tenant, ids,
                        self.engine.engine.config.share_prefix_across_tenants)
            try:
                out = await anext(outputs)
            except ValueError as e:
                phase.set_status(trace.StatusCode.ERROR, str(e))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            phase.set_attribute("kvfleet.cached_tokens", out.cached_tokens)
            phase.end()
            phase = tracer.start_span("decode")
            pending_ids: list[int] = []
            pending_text: list[str] = []
            while True:
                if out.refusal is not None:
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, out.error,
                                        trailing_metadata=((REFUSAL_KEY, out.refusal.reason),))
                completion = out.completion_tokens
                pending_ids += out.new_token_ids
                pending_text.append("".join(detok.push(t) for t in out.new_token_ids) if detok else out.new_text)
                if out.finished or len(pending_ids) >= self.stream_interval:
                    yield compute_pb2.ComputeChunk(
                        token_ids=pending_ids, text="".join(pending_text),
                        finish_reason=FINISH.get(out.finish_reason, inference_pb2.FINISH_REASON_UNSPECIFIED),
                        usage=inference_pb2.Usage(prompt_tokens=out.prompt_tokens,
                                                  completion_tokens=out.completion_tokens,
                                                  cached_tokens=out.cached_tokens),
                    )
                    pending_ids, pending_text = [], []
                if out.finished:
                    break
                out = await anext(outputs)
        finally:
            await outputs.aclose()  # aborts the engine's request if the router went away
            if self.remote is not None:
                self.remote.trace_contexts.pop(request.request_id, None)
                self.remote.allocator.forget(request.request_id)
            phase.set_attribute("kvfleet.completion_tokens", completion)
            phase.end()
            span.set_attribute("kvfleet.completion_tokens", completion)
            self.status.num_in_flight -= 1
            if self.status.num_in_flight == 0:
                self.status.idle.set()

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
        )


async def warm_up(engine: AsyncEngine, node_id: str, seed: int = 0) -> float:
    """Touch every kernel path before the node takes traffic (extensions built, caches hot): a
    random-token prefill over several blocks batched with a short one, greedy and sampled decode,
    then a prefill that starts from cached prefix blocks. Returns the seconds it took."""
    import random  # noqa: PLC0415

    from compute_service.sampling import SamplingParams  # noqa: PLC0415

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
