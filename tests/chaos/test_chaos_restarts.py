"""Peers die under streaming load and come back: block_service, a compute node, the router, etcd.

Each test streams greedy requests of two tenants from a few clients, applies its fault, lets the
load run on past the recovery, and hands what the clients saw to the shared checker (processes,
health, a token-exact probe, no leaked block, block_service's durable invariants, statuses and
tokens). Which failed statuses a fault excuses, and why, is its ``FaultPolicy``.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
from chaos_checker import report
from chaos_load import LoadGenerator
from chaos_outcomes import FaultPolicy, RequestSpec

from kvfleet.v1 import inference_pb2_grpc

LEASE_TTL_S = 2
COMPUTE_ARGS = ("--lease-ttl", str(LEASE_TTL_S))
PROMPTS = {f"p{i}": (length, 160) for i, length in enumerate((17, 33, 48, 64, 90, 130))}
STREAMS = [RequestSpec("stream", key, name, max_tokens)
           for key in ("sk-gold", "sk-free") for name in PROMPTS for max_tokens in (48, 160)]
CLIENTS = 4
DOWN_S = 1.5  # how long a killed process stays dead before it is started again

# A request is never lost to a dead block_service: the KV lives on the node and only the
# bookkeeping waits (DESIGN.md "Staying alive": retry with backoff, hold what cannot proceed).
# A request arriving while no node can take work may hear UNAVAILABLE "no READY compute node",
# the documented answer, before its first token; a stream already flowing must not break.
BLOCK_SERVICE_DOWN = FaultPolicy(
    "block_service down", "no READY node may be an answer to new requests; no stream breaks",
    excused=frozenset({"UNAVAILABLE"}))
# A dead node's requests are retried (before the first token) or resumed (after it) on the other
# node: README "The cluster", router. With one node left there is always a READY node: no excuse.
NODE_DOWN = FaultPolicy("a node down", "the router retries or resumes a dead node's requests elsewhere")
# The router is the client's only door: its death breaks every open call, and calls while it is
# down cannot connect. The client sees UNAVAILABLE, at any point of a stream (and retries).
ROUTER_DOWN = FaultPolicy("the router down", "the door itself was gone: every open call broke",
                          excused=frozenset({"UNAVAILABLE"}), mid_stream=True)
# etcd carries membership, not tokens: serving goes on while it is down. When it is back the
# nodes' leases may have lapsed until they register again, so a new request may hear "no READY
# compute node" before its first token; a node that stayed alive keeps its streams.
ETCD_DOWN = FaultPolicy("etcd down", "membership may lapse for new requests; streams on live nodes go on",
                        excused=frozenset({"UNAVAILABLE"}))


async def _under_load(cluster, checker, fault, policy: FaultPolicy, restarted: frozenset[str]) -> list[str]:
    """Load flowing, then ``fault()`` (a coroutine that breaks something and starts it again), then
    more load once the cluster serves again; every check's findings."""
    async with grpc.aio.insecure_channel(cluster.router_address) as channel:
        load = LoadGenerator(inference_pb2_grpc.InferenceStub(channel), checker.book, STREAMS, clients=CLIENTS).start()
        try:
            await load.wait_for(CLIENTS)
            started = time.monotonic()
            await fault()
            await checker.check_health()  # the fault's window ends when every part serves again
            recovered = time.monotonic()
            await load.wait_for(load.num_ended() + 2 * CLIENTS)
        finally:
            outcomes = await load.stop()
    return await checker.check(policy.within(started, recovered), outcomes, restarted)


def _kill(child) -> None:
    child.process.send_signal(signal.SIGKILL)
    child.process.wait()


def test_block_service_sigkill_and_restart(cluster, checker):
    async def fault():
        _kill(cluster.block_service)
        await asyncio.sleep(DOWN_S)
        cluster.restart_child("block_service", wait=False)  # this thread: see restart_child

    problems = asyncio.run(_under_load(cluster, checker, fault, BLOCK_SERVICE_DOWN, frozenset({"block_service"})))
    assert not problems, report(problems)


def test_node_sigkill_and_restart(cluster, checker):
    async def fault():
        _kill(cluster.nodes["node-0"])
        await asyncio.sleep(DOWN_S)
        cluster.restart_child("node-0", wait=False)  # this thread: see restart_child

    problems = asyncio.run(_under_load(cluster, checker, fault, NODE_DOWN, frozenset({"node-0"})))
    assert not problems, report(problems)


def test_router_sigkill_and_restart(cluster, checker):
    async def fault():
        _kill(cluster.router)
        await asyncio.sleep(DOWN_S)
        cluster.restart_child("router", wait=False)  # this thread: see restart_child

    problems = asyncio.run(_under_load(cluster, checker, fault, ROUTER_DOWN, frozenset({"router"})))
    assert not problems, report(problems)


def test_etcd_stop_longer_than_the_lease_then_start(cluster, checker):
    async def fault():
        await asyncio.to_thread(cluster.etcd.stop)
        await asyncio.sleep(LEASE_TTL_S + 3)  # every node's lease expires meanwhile
        cluster.etcd.start()  # from this thread, which outlives it (etcd dies with the thread that started it)

    problems = asyncio.run(_under_load(cluster, checker, fault, ETCD_DOWN, frozenset()))
    assert not problems, report(problems)


def test_etcd_frozen_past_the_lease(cluster, checker):
    """etcd paused (SIGSTOP) longer than the lease: on waking it revokes every node's lease before
    it reads their keep-alives (a restarted etcd renews leases instead), so the router sees every
    node leave and drops their pools in block_service while the nodes live on."""
    async def fault():
        cluster.etcd.process.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(LEASE_TTL_S + 3)
        finally:
            cluster.etcd.process.send_signal(signal.SIGCONT)

    problems = asyncio.run(_under_load(cluster, checker, fault, ETCD_DOWN, frozenset()))
    assert not problems, report(problems)
