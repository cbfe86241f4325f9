"""Helpers for the process-level tests (a module of its own: ``conftest`` is not importable by name)."""

from __future__ import annotations

import random
import threading

import grpc

from kvfleet.cli.local_cluster import DEMO_TENANTS
from kvfleet.v1 import inference_pb2, inference_pb2_grpc

BLOCK_SIZE = 16

# The demo tenants (gold, free) and one with a quota of 3 blocks of the test model.
TENANTS = DEMO_TENANTS + """\
  - name: tiny
    api_key: sk-tiny
    quota_mib: 0.1
    paid_level: 0
    max_concurrent: 4
"""


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def request(tokens=None, text=None, max_tokens=8, request_id="", **sampling):
    req = inference_pb2.GenerateRequest(request_id=request_id,
                                        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, **sampling))
    if tokens is not None:
        req.tokens.ids.extend(tokens)
    if text is not None:
        req.text = text
    return req


def stream(address: str, req, api_key: str = "sk-gold", timeout: float = 120.0):
    """The chunks of one Generate call (a list); raises grpc.RpcError."""
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        return list(stub.Generate(req, metadata=[("authorization", f"Bearer {api_key}")], timeout=timeout))


class Streams:
    """One greedy Generate per prompt, each streamed in its own thread. ``wait_decoding()`` returns
    once every stream has received its third chunk; after ``join()``, ``results[i]`` is stream i's
    tokens, or the exception that ended it."""

    def __init__(self, address: str, prompts: list[list[int]], max_tokens: int, api_key: str = "sk-gold"):
        self.address, self.prompts, self.max_tokens, self.api_key = address, prompts, max_tokens, api_key
        self.results: list = [None] * len(prompts)
        self._decoding = threading.Barrier(len(prompts) + 1)
        self._threads = [threading.Thread(target=self._one, args=(i,)) for i in range(len(prompts))]
        for t in self._threads:
            t.start()

    def _one(self, i: int) -> None:
        got: list[int] = []
        try:
            with grpc.insecure_channel(self.address) as channel:
                call = inference_pb2_grpc.InferenceStub(channel).Generate(
                    request(tokens=self.prompts[i], max_tokens=self.max_tokens, ignore_eos=True),
                    metadata=[("authorization", f"Bearer {self.api_key}")], timeout=300)
                for n, chunk in enumerate(call):
                    got.extend(chunk.token_ids)
                    if n == 2:
                        self._decoding.wait(60)
            self.results[i] = got
        except Exception as e:  # reported by the test, with the others
            self.results[i] = e

    def wait_decoding(self, timeout: float = 120.0) -> None:
        self._decoding.wait(timeout)

    def join(self, timeout: float = 300.0) -> list:
        for t in self._threads:
            t.join(timeout)
        return self.results


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def block_pools(cluster) -> dict:
    """Node id → block_service's ``NodeStats`` for that node's pool."""
    import asyncio

    from kvfleet.block_service.client import BlockManagerClient

    address = cluster.block_service_address  # with a standby: read from etcd, outside the loop below

    async def read():
        async with BlockManagerClient(address) as client:
            nodes, _ = await client.stats()
        return {n.node_id: n for n in nodes}

    return asyncio.run(read())


def released_pool(cluster, node_id: str = "node-0", within_s: float = 60.0):
    """block_service's ``NodeStats`` for ``node_id`` once it holds no sequence and no block in use: a
    finished or cancelled request's blocks are freed shortly after its stream ends, not before the
    client sees the end. Fails naming what is still held after ``within_s``."""
    import time

    deadline = time.monotonic() + within_s
    while (pool := block_pools(cluster)[node_id]).num_sequences or pool.num_used:
        assert time.monotonic() < deadline, f"blocks still held after the requests ended: {pool}"
        time.sleep(0.1)
    return pool
