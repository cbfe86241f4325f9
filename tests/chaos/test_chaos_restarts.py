"""Peers die under streaming load and come back: block_service, a compute node, the router, etcd.

Each test streams greedy requests of two tenants from a few clients, applies its fault, lets the
load run on past the recovery, and hands what the clients saw to the shared checker (processes,
health, a token-exact probe, no leaked block, block_service's durable invariants, statuses and
tokens). Which failed statuses a fault excuses, and why, is its ``FaultPolicy`` (``chaos_cluster``).
"""

from __future__ import annotations

import asyncio
import time

import grpc
from chaos_checker import report
from chaos_cluster import (
    BLOCK_SERVICE_DOWN,
    ETCD_DOWN,
    NODE_DOWN,
    ROUTER_DOWN,
    freeze_etcd,
    kill_and_restart,
    restart_etcd,
)
from chaos_load import LoadGenerator
from chaos_outcomes import FaultPolicy, RequestSpec

from kvfleet.v1 import inference_pb2_grpc

PROMPTS = {f"p{i}": (length, 160) for i, length in enumerate((17, 33, 48, 64, 90, 130))}
STREAMS = [RequestSpec("stream", key, name, max_tokens)
           for key in ("sk-gold", "sk-free") for name in PROMPTS for max_tokens in (48, 160)]
CLIENTS = 4


async def _under_load(cluster, checker, fault, policy: FaultPolicy, restarted: frozenset[str]) -> list[str]:
    """Load flowing, then ``fault`` (a coroutine: break something, start it again), then more load
    once the cluster serves again; every check's findings."""
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        load = LoadGenerator(inference_pb2_grpc.InferenceStub(channel), checker.book, STREAMS, clients=CLIENTS).start()
        try:
            await load.wait_for(CLIENTS)
            started = time.monotonic()
            await fault
            await checker.check_health()  # the fault's window ends when every part serves again
            # ... and the clients' channel has reconnected: a channel that lost the router backs off
            # (1 s, 1.6 s, 2.6 s, ...), and a request in its backoff fails at once, before any node
            # is asked; that is the outage still, as this client sees it, not a broken contract
            await asyncio.wait_for(channel.channel_ready(), 60)
            recovered = time.monotonic()
            await load.wait_for(load.num_ended() + 2 * CLIENTS)
        finally:
            outcomes = await load.stop()
    return await checker.check(policy.within(started, recovered), outcomes, restarted)


def test_block_service_sigkill_and_restart(cluster, checker):
    fault = kill_and_restart(cluster, "block_service")
    problems = asyncio.run(_under_load(cluster, checker, fault, BLOCK_SERVICE_DOWN, frozenset({"block_service"})))
    assert not problems, report(problems)


def test_node_sigkill_and_restart(cluster, checker):
    fault = kill_and_restart(cluster, "node-0")
    problems = asyncio.run(_under_load(cluster, checker, fault, NODE_DOWN, frozenset({"node-0"})))
    assert not problems, report(problems)


def test_router_sigkill_and_restart(cluster, checker):
    fault = kill_and_restart(cluster, "router")
    problems = asyncio.run(_under_load(cluster, checker, fault, ROUTER_DOWN, frozenset({"router"})))
    assert not problems, report(problems)


def test_etcd_stopped_longer_than_the_lease_then_started(cluster, checker):
    problems = asyncio.run(_under_load(cluster, checker, restart_etcd(cluster), ETCD_DOWN, frozenset()))
    assert not problems, report(problems)


def test_etcd_frozen_past_the_lease(cluster, checker):
    """Every node's lease lapses while the nodes live on (the router dropped their
    pools in block_service, and the nodes died on "unknown node")."""
    problems = asyncio.run(_under_load(cluster, checker, freeze_etcd(cluster), ETCD_DOWN, frozenset()))
    assert not problems, report(problems)
