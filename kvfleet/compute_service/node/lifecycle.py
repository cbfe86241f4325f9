"""A compute node's life in its event loop: start, serve until SIGTERM, drain, shut down.

    etcd: WARMING → block_service link → load model, size pool → serve gRPC → [restore KV snapshot]
    → warm up → etcd: READY → ... SIGTERM → etcd: DRAINING → running requests finish
    → [write KV snapshot] → blocks released → lease revoked → exit 0

Every step before READY can wait on a peer (etcd, block_service) for as long as it is away, so the
whole start runs under SIGTERM: a node told to stop while starting stops, closing what it had
started, instead of lingering until its peers come back (a node orphaned by a killed test or
supervisor was seen waiting for an hour). Only its own engine thread dying ends a READY node
without a drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kvfleet.compute_service.node import warm_start
from kvfleet.compute_service.node.settings import NodeCommand

if TYPE_CHECKING:
    import aetcd
    import grpc
    from grpc_health.v1 import health

    from kvfleet.block_service.client import BlockManagerClient
    from kvfleet.compute_service.blocks.complaint import LeaderComplaint
    from kvfleet.compute_service.blocks.registration import RemoteAllocatorFactory
    from kvfleet.compute_service.blocks.remote_allocator import OnRefused, RemoteBlockAllocator
    from kvfleet.compute_service.engine.async_engine import AsyncEngine
    from kvfleet.compute_service.engine.live_cap import LiveCap
    from kvfleet.compute_service.engine.llm_engine import LLMEngine
    from kvfleet.compute_service.node.context import EarlyBlocks, NodeContext, NodeStatus
    from kvfleet.compute_service.node.peer_directory import PeerDirectory
    from kvfleet.compute_service.node.prefix_fetch import PrefixFetcher
    from kvfleet.compute_service.node.server import ComputeServicer
    from kvfleet.core.health_port import Readiness
    from kvfleet.core.membership import NodeRegistration

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Parts:
    """What the node has started so far: the way out closes these, whatever the start reached."""
    client: aetcd.Client | None = None                  # etcd client
    registration: NodeRegistration | None = None        # the node's membership record and lease
    remote: RemoteAllocatorFactory | None = None        # the block_service link (None: an in-process pool)
    complaint: LeaderComplaint | None = None            # says in etcd when the block_service leader is unreachable
    async_engine: AsyncEngine | None = None
    server: grpc.aio.Server | None = None
    readiness: Readiness | None = None                  # the health-only port, the certificate's watch
    peers: PeerDirectory | None = None                  # other nodes' addresses, for KV fetches
    drained: bool = False


@dataclass(slots=True)
class _Ready:
    """What a READY node serves with, until it drains."""
    async_engine: AsyncEngine
    servicer: ComputeServicer
    health: health.aio.HealthServicer
    status: NodeStatus
    warm: warm_start.WarmStart
    registration: NodeRegistration | None
    live_cap: LiveCap | None
    blocks: RemoteBlockAllocator | None  # the pool's allocator at block_service (None: an in-process pool)


async def _watch_engine(async_engine: AsyncEngine, stop: asyncio.Event) -> None:
    """A step that raises fails its requests and the thread goes on; should the thread die anyway,
    the node must not linger as a black hole (last resort)."""
    while async_engine.is_alive():
        await asyncio.sleep(1.0)
    stop.set()


async def _resync_on_new_lease(registration: NodeRegistration, blocks: RemoteBlockAllocator) -> None:
    """etcd lost the node's lease and the registration took a new one: the router may have dropped
    this node's pool from block_service meanwhile, so sync it (a no-op when it did not)."""
    lease = registration.lease_id
    while True:
        await asyncio.sleep(1.0)
        if registration.lease_id not in (lease, None):
            lease = registration.lease_id
            log.info("node %s registered again in etcd; syncing its pool with block_service", blocks.node_id)
            blocks.syncs.trouble()


def _complain(parts: _Parts, node_id: str, blocks: BlockManagerClient) -> None:
    """With etcd: probe block_service's leader from now on, and say in etcd when it is unreachable."""
    from kvfleet.compute_service.blocks.complaint import LeaderComplaint

    registration = parts.registration
    if parts.client is not None and registration is not None:
        parts.complaint = LeaderComplaint(node_id, parts.client, blocks, lambda: registration.lease_id)
        parts.complaint.start()


def _build_engine(command: NodeCommand, remote: RemoteAllocatorFactory | None) -> LLMEngine:
    from kvfleet.compute_service.engine.llm_engine import LLMEngine
    from kvfleet.core.preflight import PreflightError

    try:
        return LLMEngine(command.model, command.engine_config(), allocator_factory=remote)
    except ValueError as e:  # the pool cannot hold what the flags ask (one block, one reservation)
        raise PreflightError(str(e)) from None


def _live_cap(command: NodeCommand, engine: LLMEngine) -> LiveCap | None:
    """The P99 batch controller over the engine's scheduler; None without a target."""
    target_ms, every_s = command.settings.p99_itl_target_ms, command.settings.control_interval_s
    if target_ms is None:
        return None
    import time

    from kvfleet.compute_service.engine.batch_controller import BatchController, ControllerConfig
    from kvfleet.compute_service.engine.live_cap import LiveCap

    config = ControllerConfig(target_ms / 1000, engine.config.max_num_seqs, interval_s=every_s, window_s=10 * every_s)
    log.info("node %s: P99 batch controller on, target %.1f ms, every %.1f s", command.node_id, target_ms, every_s)
    return LiveCap(BatchController(config, time.monotonic()), engine.scheduler, command.node_id)


async def _publish_cap(registration: NodeRegistration, live_cap: LiveCap, every_s: float) -> None:
    """Write the live cap into the node's membership record when it changed, at most once every
    ``every_s`` (the routers sum the READY nodes' caps into their admission capacity)."""
    published = live_cap.cap
    while True:
        await asyncio.sleep(every_s)
        if live_cap.cap != published:
            published = live_cap.cap
            await registration.update(max_num_seqs=published)


def _early_blocks(remote: RemoteAllocatorFactory, blocks: RemoteBlockAllocator, engine: LLMEngine) -> EarlyBlocks:
    """What a request stream may do with block_service directly."""
    from kvfleet.compute_service.node.context import EarlyBlocks

    share, reserve = engine.config.share_prefix_across_tenants, engine.kv.reserve_tokens
    blocks.cap_length(engine.max_model_len)

    async def preallocate(seq_id: str, tenant: str, token_ids: list[int], prefix_group: str = "") -> None:
        await blocks.preallocate(seq_id, tenant, token_ids, share, reserve, prefix_group)

    return EarlyBlocks(preallocate, blocks.release_unclaimed, remote.trace_contexts)


def _prefix_fetcher(command: NodeCommand, parts: _Parts, async_engine: AsyncEngine) -> PrefixFetcher | None:
    """Fetching prompts' cached prefixes from peers: needs block_service (where is it held?) and
    etcd (where are the peers?)."""
    from kvfleet.compute_service.node.fetch_policy import FetchCost
    from kvfleet.compute_service.node.peer_directory import PeerDirectory
    from kvfleet.compute_service.node.prefix_fetch import PrefixFetcher

    settings = command.settings.kv_fetch
    if settings.kv_fetch == "off" or parts.remote is None or parts.client is None:
        return None
    engine = async_engine.engine
    parts.peers = PeerDirectory(command.node_id)
    parts.peers.start(parts.client)
    cost = FetchCost(settings, engine.allocator.block_size, engine.bytes_per_block)
    return PrefixFetcher(command.node_id, async_engine, parts.remote.client.match_tiers, parts.peers, cost,
                         engine.kv.seed, engine.config.share_prefix_across_tenants)


def _fail_refused(async_engine: AsyncEngine) -> OnRefused:
    """The remote allocator's ``on_refused``: sequences block_service would not hold after a sync
    (it moved them to other nodes) end here."""
    def fail(seq_ids: list[str], why: str) -> None:
        for seq_id in seq_ids:
            async_engine.fail(seq_id, why)
    return fail


async def _unless_stopped(work, stop: asyncio.Event):
    """``work``'s result, or None when ``stop`` is set first: a node waiting for a peer must still
    obey Ctrl-C and SIGTERM."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def serve(command: NodeCommand) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parts = _Parts()
    try:
        ready = await _unless_stopped(_start(command, parts), stop)
        if ready is None:
            log.info("node %s stopped before it was READY", command.node_id)
            return
        await _serve_until_stopped(command, ready, stop)
        parts.drained = True
    finally:
        await _shut_down(command, parts)


async def _start(command: NodeCommand, parts: _Parts) -> _Ready:
    """Everything up to READY, each part that needs closing recorded in ``parts`` as soon as it exists."""
    from grpc_health.v1 import health_pb2

    from kvfleet.compute_service.engine.async_engine import AsyncEngine
    from kvfleet.compute_service.node.context import NodeContext, NodeStatus
    from kvfleet.compute_service.node.server import ComputeServicer, add_to_server, warm_up
    from kvfleet.core import rpc
    from kvfleet.core.health_port import Readiness
    from kvfleet.core.membership import NodeInfo, NodeRegistration, NodeState, etcd_client

    node_id, settings = command.node_id, command.settings
    # etcd first (WARMING, pool size unknown yet), block_service second: a previous run's lease
    # expiring can then no longer make the router drop the pool this run is about to register.
    registration = None
    if command.etcd:
        log.info("node %s: registering in etcd at %s", node_id, command.etcd)
        parts.client = etcd_client(command.etcd)
        await parts.client.connect()
        info = NodeInfo(node_id, command.advertise or "", command.model, 0, 0, NodeState.WARMING, role=command.role,
                        group=command.group,
                        fetches_kv=settings.kv_fetch.kv_fetch != "off" and bool(command.block_service))
        registration = parts.registration = NodeRegistration(parts.client, info, ttl=command.lease_ttl)
        await registration.start()
    remote = None
    if command.block_service:
        from kvfleet.compute_service.blocks.registration import RemoteAllocatorFactory

        remote = parts.remote = await RemoteAllocatorFactory.connect(command.block_service, node_id,
                                                                     asyncio.get_running_loop(), command.etcd,
                                                                     partial(_complain, parts, node_id))
    engine = await asyncio.to_thread(_build_engine, command, remote)
    pool = engine.allocator
    live_cap = _live_cap(command, engine)
    async_engine = parts.async_engine = AsyncEngine(engine, batch_wait_s=settings.batch_wait_ms / 1000,
                                                    after_step=live_cap.after_step if live_cap is not None else None)
    blocks = remote.allocator if remote is not None else None  # built by the engine through the factory
    if remote is None or blocks is None:
        status, early = NodeStatus(node_id, role=command.role), None
    else:
        blocks.on_refused = _fail_refused(async_engine)
        status = NodeStatus(node_id, role=command.role, block_rpcs=lambda: blocks.num_rpcs,
                            reconciled=lambda: blocks.link.num_reconciled,
                            block_sync_calls=lambda: {"allocate": blocks.num_sync_allocates,
                                                      "extend": blocks.num_sync_extends})
        early = _early_blocks(remote, blocks, engine)
    node = NodeContext(status, async_engine, pool.block_size, settings.stream_interval, early,
                       _prefix_fetcher(command, parts, async_engine))
    if command.metrics_port is not None:
        _serve_metrics(command, node, status, pool.block_size)
    server = parts.server = rpc.server(internal=True)
    servicer = ComputeServicer(node)
    add_to_server(servicer, server)  # FetchBlocks sends its frames as they are
    # "" answers while the process does (liveness); kvfleet.v1.Compute is SERVING while READY
    health = rpc.serve_health_and_reflection(server, "kvfleet.v1.Compute")
    await health.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = rpc.bind_internal(server, command.listen)
    if port == 0:  # taken since the preflight found it free
        from kvfleet.core.preflight import PreflightError
        raise PreflightError(f"cannot listen on {command.listen}: the port is in use")
    await server.start()
    parts.readiness = await Readiness.start(health, "kvfleet.v1.Compute", command.listen, command.health_port,
                                            command.tls.cert_warn_days, f"node {node_id}")
    address = command.advertise or f"{command.listen.rsplit(':', 1)[0]}:{port}"
    if registration is not None:
        await registration.update(address=address, num_blocks=pool.num_blocks, block_size=pool.block_size,
                                  max_num_seqs=live_cap.cap if live_cap is not None else engine.config.max_num_seqs,
                                  long_prefill_token_threshold=engine.config.long_prefill_token_threshold)
    warm = warm_start.WarmStart(settings.warm_start, node_id, command.model, async_engine,
                                blocks.flush if blocks is not None else None)
    await warm.restore()  # before the warm-up: its random blocks must not take the pool's room first
    seconds = await warm_up(async_engine, node_id, block_size=pool.block_size, max_model_len=engine.max_model_len,
                            vocab_size=engine.model_config.vocab_size)
    seconds += await warm.random_prefill(engine.model_config.vocab_size, engine.max_model_len)
    status.state = NodeState.READY
    if registration is not None:
        await registration.set_state(NodeState.READY)
    await health.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.SERVING)
    log.info("node %s READY on %s after a %.1fs warm-up (%d blocks of %d tokens)", node_id, address,
             seconds, pool.num_blocks, pool.block_size)
    if command.port_file:
        with open(command.port_file, "w") as f:
            f.write(str(port))
    return _Ready(async_engine, servicer, health, status, warm, registration, live_cap, blocks)


async def _serve_until_stopped(command: NodeCommand, ready: _Ready, stop: asyncio.Event) -> None:
    """READY until SIGTERM, then the drain: running requests may finish for ``--drain-timeout``."""
    from grpc_health.v1 import health_pb2

    from kvfleet.core.membership import NodeState

    settings, registration, status = command.settings, ready.registration, ready.status
    background = [asyncio.create_task(_watch_engine(ready.async_engine, stop))]
    ready.warm.start_periodic()
    if ready.live_cap is not None and registration is not None:
        every_s = max(settings.control_interval_s, 1.0)
        background.append(asyncio.create_task(_publish_cap(registration, ready.live_cap, every_s)))
    if registration is not None:
        from kvfleet.compute_service.node.rates import publish_rates

        fetcher = ready.servicer.node.prefix_fetch
        background.append(asyncio.create_task(publish_rates(registration, ready.async_engine.engine, fetcher)))
    if ready.blocks is not None:
        ready.blocks.syncs.start_reconciling(settings.reconcile_interval)
        if registration is not None:
            background.append(asyncio.create_task(_resync_on_new_lease(registration, ready.blocks)))
    await stop.wait()
    for task in background:
        task.cancel()
    if not ready.async_engine.is_alive():
        # Crash-only: no drain, no clean goodbye. The streams break, the router resumes them on
        # other nodes, the lease expires and block_service is told to drop this pool.
        log.error("node %s: the engine's step thread died; exiting so the cluster routes around it", command.node_id)
        if registration is not None:  # leave etcd now rather than after the lease's TTL
            with contextlib.suppress(Exception):
                await asyncio.wait_for(registration.close(), 1.0)
        os._exit(1)
    log.info("node %s draining (%d requests in flight)", command.node_id, status.num_in_flight)
    status.state = NodeState.DRAINING
    await ready.health.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.NOT_SERVING)
    if registration is not None:
        try:
            await registration.set_state(NodeState.DRAINING)
        except Exception as e:  # etcd down: the router learns it when the stream ends or the lease goes
            log.warning("node %s: could not announce DRAINING in etcd: %s", command.node_id, e)
    try:
        await asyncio.wait_for(status.idle.wait(), settings.drain_timeout)
    except asyncio.TimeoutError:
        log.warning("drain timed out with %d requests in flight; aborting them", status.num_in_flight)
    ready.servicer.end_streams()  # what is left is aborted and its blocks released; routers resume it elsewhere
    await ready.warm.on_drain()


async def _shut_down(command: NodeCommand, parts: _Parts) -> None:
    """Whatever was started, in order: the server (a grace period after a drain), the engine's step
    thread, block_service's link, the etcd lease. A peer that is away cannot hold the exit up."""
    if parts.readiness is not None:
        await parts.readiness.close()
    if parts.peers is not None:
        await parts.peers.close()
    if parts.server is not None:
        await parts.server.stop(grace=2 if parts.drained else 0)
    if parts.async_engine is not None:
        await asyncio.to_thread(parts.async_engine.shutdown)
    if parts.complaint is not None:
        await parts.complaint.close()
    if parts.remote is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(parts.remote.close(), 5.0)
    if parts.registration is not None:
        try:
            await asyncio.wait_for(parts.registration.close(), 5.0)
        except Exception as e:  # etcd down: the lease expires on its own
            log.warning("node %s: could not revoke its etcd lease: %s", command.node_id, e)
    if parts.client is not None:
        await parts.client.close()
    log.info("node %s stopped", command.node_id)


def _serve_metrics(command: NodeCommand, node: NodeContext, status: NodeStatus, block_size: int) -> None:
    """The metrics endpoint, from the start of the warm-up on (``kvfleet:node_state`` tells)."""
    from functools import partial

    from prometheus_client import CollectorRegistry

    from kvfleet.compute_service.node import metrics
    from kvfleet.core.metrics_server import LoopCollector, metrics_listen, serve_metrics

    registry = CollectorRegistry()
    read = partial(metrics.sample, node, status, block_size, command.group)
    registry.register(LoopCollector(asyncio.get_running_loop(), read, metrics.families))
    serve_metrics(registry, metrics_listen(command.listen, command.metrics_port), f"node {command.node_id}")
