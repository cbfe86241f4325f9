"""Helpers for the process-level tests (a module of its own: ``conftest`` is not importable by name)."""

from __future__ import annotations

import random

import grpc

from kvfleet.v1 import inference_pb2, inference_pb2_grpc
from kvfleet_cli.local_cluster import DEMO_TENANTS

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


def tokens_of(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def block_pools(cluster) -> dict:
    """Node id → block_service's ``NodeStats`` for that node's pool."""
    import asyncio

    from block_service.client import BlockManagerClient

    address = cluster.block_service_address  # with a standby: read from etcd, outside the loop below

    async def read():
        async with BlockManagerClient(address) as client:
            nodes, _ = await client.stats()
        return {n.node_id: n for n in nodes}

    return asyncio.run(read())
