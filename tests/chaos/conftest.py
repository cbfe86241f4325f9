"""One real cluster per chaos module (``chaos_cluster``: etcd, block_service, two nodes, a router,
tiny model, blocks of 16), its prompts' greedy references, and before each test a whole cluster at
rest: whatever the test before broke (a dead child, a leaked sequence) is repaired here, so each
test fails for its own fault only.

A module names its prompts in ``PROMPTS`` (name → (prompt tokens, reference tokens)).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from chaos_checker import ClusterChecker
from chaos_cluster import start_cluster
from chaos_load import PromptBook

from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.cli.model_maker import make_model
from kvfleet.core import rpc
from kvfleet.core.identity import BLOCK_SERVICE_ID
from kvfleet.v1 import block_manager_pb2, block_manager_pb2_grpc, inference_pb2_grpc

REST_TIMEOUT_S = 15.0


@pytest.fixture(scope="session")
def chaos_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("chaos-model") / "tiny", "tiny", seed=11)


@pytest.fixture(scope="module")
def cluster(chaos_model, tmp_path_factory):
    c = start_cluster(chaos_model, tmp_path_factory.mktemp("chaos-cluster"))
    try:
        yield c
    finally:
        c.stop()
        leftovers = [child.name for child in c.children() if child.alive()]
        assert not leftovers, f"processes left running: {leftovers}"


@pytest.fixture(scope="module")
def book(cluster, request) -> PromptBook:
    prompts = request.module.PROMPTS
    book = PromptBook.seeded({name: n for name, (n, _) in prompts.items()}, seed=3)

    async def record():
        async with grpc.aio.insecure_channel(cluster.router_address) as channel:
            await book.record_references(inference_pb2_grpc.InferenceStub(channel), "sk-gold",
                                         {name: m for name, (_, m) in prompts.items()})

    asyncio.run(record())
    return book


@pytest.fixture
def checker(cluster, book) -> ClusterChecker:
    """A checker whose baseline is this cluster whole and at rest."""
    checker = ClusterChecker(cluster, book)
    asyncio.run(repair(cluster, checker))
    asyncio.run(checker.baseline())
    return checker


async def repair(cluster: LocalCluster, checker: ClusterChecker) -> None:
    """Bring back what an earlier test left broken: exited processes, and nodes whose sequences
    block_service still holds at rest (a restarted node drops its old pool)."""
    for name, code in cluster.exited().items():
        print(f"repair: restarting {name} (exit {code})")
        cluster.restart(name)
    await checker.check_health()  # waits for it; what stays broken, the test's own checks report
    for node_id in await _nodes_holding_sequences(cluster.block_service_address, REST_TIMEOUT_S):
        print(f"repair: {node_id} still holds sequences at rest; restarting it")
        cluster.kill(node_id)
        cluster.restart(node_id)
    await checker.check_health()


async def _nodes_holding_sequences(address: str, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    async with rpc.channel(address, peer=BLOCK_SERVICE_ID) as channel:  # as the cluster's admin
        stub = block_manager_pb2_grpc.BlockManagerStub(channel)
        while True:
            stats = await stub.Stats(block_manager_pb2.BlockStatsRequest(), timeout=5)
            holding = [n.node_id for n in stats.nodes if n.num_sequences]
            if not holding or time.monotonic() > deadline:
                return holding
            await asyncio.sleep(0.2)
