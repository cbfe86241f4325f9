"""Two compute nodes in one process for the KV fetch tests: real engines (tiny llama, in-process page
tables), the holder's ``Compute`` servicer on a real gRPC server over loopback, and the receiver's
``fetch_blocks``. Engines are used synchronously before and after a fetch, and on their engine
threads (``AsyncEngine``) during it, never both at once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import torch

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.compute_service.engine.request_output import RequestOutput
from kvfleet.compute_service.kv.pool import bytes_per_block
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.compute_service.node.context import NodeContext, NodeStatus
from kvfleet.compute_service.node.kv_fetch import fetch_blocks, fetch_over
from kvfleet.compute_service.node.server import ComputeServicer, add_to_server
from kvfleet.core import rpc
from kvfleet.core.block_hash import block_hashes, cluster_seed, tenant_extra_key
from kvfleet.core.identity import Identity
from kvfleet.core.sampling import SamplingParams
from kvfleet.v1 import compute_pb2_grpc
from tests.compute_service.conftest import random_prompt

BS = 16
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPT = random_prompt(4 * BS + 5, seed=61)   # 4 reusable blocks
OTHERS = [random_prompt(100, seed=70 + i) for i in range(3)]
HOLDER = "holder"
_ids = itertools.count()


def make_engine(model_dir, pool_blocks: int = 64, kv_cache_dtype: str = "auto", **tiers) -> LLMEngine:
    per = bytes_per_block(ModelConfig.from_dir(model_dir), BS, "fp8_e4m3" if kv_cache_dtype == "fp8_e4m3" else "float32")
    return LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BS, kv_cache_memory=pool_blocks * per,
                                             kv_cache_dtype=kv_cache_dtype, **tiers))


def per_block(model_dir) -> int:
    return bytes_per_block(ModelConfig.from_dir(model_dir), BS, "float32")


def hashes_of(prompt: list[int], tenant: str, num_blocks: int | None = None) -> list[bytes]:
    return block_hashes(prompt, BS, tenant_extra_key(tenant), cluster_seed(), max_blocks=num_blocks)


def serve(engine: LLMEngine, prompt: list[int], tenant: str = "default", sampling: SamplingParams = GREEDY):
    """One request through ``engine`` synchronously, as ``tenant``: its merged RequestOutput."""
    merged = RequestOutput.empty("r")
    engine.add_request(f"r-{next(_ids)}", prompt, sampling, tenant=tenant)
    while engine.has_unfinished_requests():
        for out in engine.step():
            merged = merged.merged(out)
    return merged


def rows(engine: LLMEngine, hashes: list[bytes]) -> dict[bytes, tuple[torch.Tensor, torch.Tensor | None]]:
    """K and V (and FP8 scales) of the pool blocks holding ``hashes``, by hash (those it holds)."""
    found = {}
    for h in hashes:
        block = engine.kv.usage.find(h)
        if block is not None:
            scales = engine.runner.kv_scales
            found[h] = (engine.runner.kv_cache[:, :, block.block_id].clone(),
                        None if scales is None else scales[:, :, block.block_id].clone())
    return found


def identical(a: tuple, b: tuple) -> bool:
    same_kv = torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8))
    return same_kv and (a[1] is None) == (b[1] is None) and (a[1] is None or torch.equal(a[1], b[1]))


def counts(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.allocator.stats()
    return s.num_free, s.num_cached, s.num_used


Wrap = Callable[[Callable[..., AsyncIterator]], Callable[..., AsyncIterator]]


@contextlib.asynccontextmanager
async def peers(holder: LLMEngine, receiver: LLMEngine, register: Callable = add_to_server):
    """``(holder's address, receiver's AsyncEngine)``: the holder serving ``Compute`` over loopback
    (under this process's TLS credentials at the time, if any), registered by ``register``; both
    engines' threads stopped after."""
    h, r = AsyncEngine(holder), AsyncEngine(receiver)
    server = rpc.server(internal=True)
    register(ComputeServicer(NodeContext(NodeStatus(HOLDER), h, BS)), server)
    port = rpc.bind_internal(server, "127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", r
    finally:
        await server.stop(grace=0)
        for engine in (h, r):
            await asyncio.to_thread(engine.shutdown)


def fetch(holder: LLMEngine, receiver: LLMEngine, tenant: str, hashes: list[bytes], wrap: Wrap | None = None,
          deadline_s: float = 30.0, address: str | None = None, register: Callable = add_to_server) -> int:
    """Serve ``holder`` and have ``receiver`` fetch ``hashes`` for ``tenant`` (through ``wrap``'s
    double of the stream when given; from ``address`` instead when given); the blocks held after it."""
    async def main() -> int:
        async with peers(holder, receiver, register) as (served_at, r):
            if wrap is None:
                return (await fetch_blocks(address or served_at, HOLDER, tenant, hashes, r, deadline_s)).blocks
            async with rpc.channel(served_at, max_receive_bytes=rpc.MAX_MESSAGE_BYTES,
                                   peer=Identity.node(HOLDER)) as channel:
                call = wrap(compute_pb2_grpc.ComputeStub(channel).FetchBlocks)
                return (await fetch_over(call, "the test's double", tenant, hashes, r, deadline_s)).blocks

    return asyncio.run(main())


def altered(change: Callable, max_chunk_bytes: int = 0) -> Wrap:
    """A double of the stream that asks for chunks of ``max_chunk_bytes`` (0: the default) and
    hands every chunk through ``change(index, chunk)`` (None: the stream ends there)."""
    def wrap(call):
        async def stream(request, timeout=None):
            request.max_chunk_bytes = max_chunk_bytes
            inner = call(request, timeout=timeout)
            try:
                i = 0
                async for chunk in inner:
                    chunk = change(i, chunk)
                    if chunk is None:
                        return
                    yield chunk
                    i += 1
            finally:
                inner.cancel()
        return stream
    return wrap
