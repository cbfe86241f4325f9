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

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from compute_service.node import warm_start

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Parts:
    """What the node has started so far: the way out closes these, whatever the start reached."""
    client: Any = None          # etcd client
    registration: Any = None    # the node's membership record and lease
    remote: Any = None          # the block_service link
    engine: Any = None
    async_engine: Any = None
    server: Any = None
    servicer: Any = None
    health: Any = None
    status: Any = None
    warm: Any = None
    live_cap: Any = None
    drained: bool = False


async def _watch_engine(async_engine, stop: asyncio.Event) -> None:
    """A step that raises fails its requests and the thread goes on; should the thread die anyway,
    the node must not linger as a black hole (last resort)."""
    while async_engine.is_alive():
        await asyncio.sleep(1.0)
    stop.set()


async def _resync_on_new_lease(registration, allocator) -> None:
    """etcd lost the node's lease and the registration took a new one: the router may have dropped
    this node's pool from block_service meanwhile, so sync it (a no-op when it did not)."""
    lease = registration.lease_id
    while True:
        await asyncio.sleep(1.0)
        if registration.lease_id not in (lease, None):
            lease = registration.lease_id
            log.info("node %s registered again in etcd; syncing its pool with block_service", allocator.node_id)
            allocator.syncs.trouble()


def _build_engine(args: argparse.Namespace, remote):
    from compute_service.engine.llm_engine import EngineConfig, LLMEngine
    from kvfleet.preflight import PreflightError

    config = EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                          kv_cache_dtype=args.kv_cache_dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          long_prefill_token_threshold=args.long_prefill_token_threshold,
                          node_id=args.node_id, kv_layout=args.kv_layout, max_model_len=args.max_model_len,
                          kv_host_memory=args.kv_host_memory, kv_disk_dir=args.kv_disk_dir,
                          kv_disk_bytes=args.kv_disk_bytes, preemption_mode=args.preemption_mode)
    try:
        return LLMEngine(args.model, config, allocator_factory=remote)
    except ValueError as e:  # the pool cannot hold what the flags ask (one block, one reservation)
        raise PreflightError(str(e)) from None


def _live_cap(args: argparse.Namespace, engine):
    """The P99 batch controller over the engine's scheduler; None without a target."""
    if args.p99_itl_target_ms is None:
        return None
    import time

    from compute_service.engine.batch_controller import BatchController, ControllerConfig
    from compute_service.engine.live_cap import LiveCap

    config = ControllerConfig(args.p99_itl_target_ms / 1000, args.max_num_seqs, interval_s=args.control_interval_s,
                              window_s=10 * args.control_interval_s)
    log.info("node %s: P99 batch controller on, target %.1f ms, every %.1f s", args.node_id,
             args.p99_itl_target_ms, args.control_interval_s)
    return LiveCap(BatchController(config, time.monotonic()), engine.scheduler, args.node_id)


async def _publish_cap(registration, live_cap, every_s: float) -> None:
    """Write the live cap into the node's membership record when it changed, at most once every
    ``every_s`` (the routers sum the READY nodes' caps into their admission capacity)."""
    published = live_cap.cap
    while True:
        await asyncio.sleep(every_s)
        if live_cap.cap != published:
            published = live_cap.cap
            await registration.update(max_num_seqs=published)


def _early_blocks(remote, engine):
    """What a request stream may do with block_service directly (None for an in-process pool)."""
    from compute_service.node.context import EarlyBlocks

    if remote is None:
        return None
    allocator, share, reserve = engine.allocator, engine.config.share_prefix_across_tenants, engine.kv.reserve_tokens
    allocator.cap_length(engine.max_model_len)

    async def preallocate(seq_id: str, tenant: str, token_ids: list[int]) -> None:
        await allocator.preallocate(seq_id, tenant, token_ids, share, reserve)

    return EarlyBlocks(preallocate, allocator.release, remote.trace_contexts)


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


async def serve(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parts = _Parts()
    try:
        if await _unless_stopped(_start(args, parts), stop) is None:
            log.info("node %s stopped before it was READY", args.node_id)
            return
        await _serve_until_stopped(args, parts, stop)
    finally:
        await _shut_down(args, parts)


async def _start(args: argparse.Namespace, parts: _Parts) -> bool:
    """Everything up to READY, each part recorded in ``parts`` as soon as it exists."""
    from grpc_health.v1 import health_pb2

    from compute_service.engine.async_engine import AsyncEngine
    from compute_service.node.context import NodeContext, NodeStatus
    from compute_service.node.server import ComputeServicer, warm_up
    from kvfleet import rpc
    from kvfleet.membership import NodeInfo, NodeRegistration, NodeState, etcd_client
    from kvfleet.v1 import compute_pb2_grpc

    # etcd first (WARMING, pool size unknown yet), block_service second: a previous run's lease
    # expiring can then no longer make the router drop the pool this run is about to register.
    if args.etcd:
        log.info("node %s: registering in etcd at %s", args.node_id, args.etcd)
        parts.client = etcd_client(args.etcd)
        await parts.client.connect()
        info = NodeInfo(args.node_id, args.advertise or "", str(args.model), 0, 0, NodeState.WARMING)
        parts.registration = NodeRegistration(parts.client, info, ttl=args.lease_ttl)
        await parts.registration.start()
    if args.block_service:
        from compute_service.blocks.registration import RemoteAllocatorFactory

        parts.remote = await RemoteAllocatorFactory.connect(args.block_service, args.node_id,
                                                            asyncio.get_running_loop(), args.etcd)
    remote, registration = parts.remote, parts.registration
    engine = parts.engine = await asyncio.to_thread(_build_engine, args, remote)
    allocator = engine.allocator
    live_cap = parts.live_cap = _live_cap(args, engine)
    async_engine = parts.async_engine = AsyncEngine(engine, batch_wait_s=args.batch_wait_ms / 1000,
                                                    after_step=live_cap.after_step if live_cap is not None else None)
    if remote is not None:  # sequences block_service would not hold after a sync move to other nodes
        allocator.on_refused = lambda seq_ids, why: [async_engine.fail(s, why) for s in seq_ids]
    status = parts.status = NodeStatus(args.node_id, block_rpcs=lambda: getattr(allocator, "num_rpcs", 0),
                                       reconciled=lambda: allocator.link.num_reconciled if remote is not None else 0)
    node = NodeContext(status, async_engine, allocator.block_size, args.stream_interval, _early_blocks(remote, engine))
    if args.metrics_port is not None:
        _serve_metrics(args, node, status, allocator.block_size)
    server = parts.server = rpc.server()
    parts.servicer = ComputeServicer(node)
    compute_pb2_grpc.add_ComputeServicer_to_server(parts.servicer, server)
    # "" answers while the process does (liveness); kvfleet.v1.Compute is SERVING while READY
    parts.health = rpc.serve_health_and_reflection(server, "kvfleet.v1.Compute")
    await parts.health.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(args.listen)
    await server.start()
    address = args.advertise or f"{args.listen.rsplit(':', 1)[0]}:{port}"
    if registration is not None:
        await registration.update(address=address, num_blocks=allocator.num_blocks, block_size=allocator.block_size,
                                  max_num_seqs=live_cap.cap if live_cap is not None else args.max_num_seqs)
    warm = parts.warm = warm_start.WarmStart(args, async_engine, allocator.flush if remote is not None else None)
    await warm.restore()  # before the warm-up: its random blocks must not take the pool's room first
    seconds = await warm_up(async_engine, args.node_id, block_size=allocator.block_size,
                            max_model_len=engine.max_model_len, vocab_size=engine.model_config.vocab_size)
    seconds += await warm.random_prefill(engine.model_config.vocab_size, engine.max_model_len)
    status.state = NodeState.READY
    if registration is not None:
        await registration.set_state(NodeState.READY)
    await parts.health.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.SERVING)
    log.info("node %s READY on %s after a %.1fs warm-up (%d blocks of %d tokens)", args.node_id, address,
             seconds, allocator.num_blocks, allocator.block_size)
    if args.port_file:
        with open(args.port_file, "w") as f:
            f.write(str(port))
    return True


async def _serve_until_stopped(args: argparse.Namespace, parts: _Parts, stop: asyncio.Event) -> None:
    """READY until SIGTERM, then the drain: running requests may finish for ``--drain-timeout``."""
    from grpc_health.v1 import health_pb2

    from kvfleet.membership import NodeState

    async_engine, registration, status = parts.async_engine, parts.registration, parts.status
    allocator = parts.engine.allocator
    background = [asyncio.create_task(_watch_engine(async_engine, stop))]
    parts.warm.start_periodic()
    if parts.live_cap is not None and registration is not None:
        every_s = max(args.control_interval_s, 1.0)
        background.append(asyncio.create_task(_publish_cap(registration, parts.live_cap, every_s)))
    if parts.remote is not None:
        allocator.syncs.start_reconciling(args.reconcile_interval)
        if registration is not None:
            background.append(asyncio.create_task(_resync_on_new_lease(registration, allocator)))
    await stop.wait()
    for task in background:
        task.cancel()
    if not async_engine.is_alive():
        # Crash-only: no drain, no clean goodbye. The streams break, the router resumes them on
        # other nodes, the lease expires and block_service is told to drop this pool.
        log.error("node %s: the engine's step thread died; exiting so the cluster routes around it", args.node_id)
        if registration is not None:  # leave etcd now rather than after the lease's TTL
            with contextlib.suppress(Exception):
                await asyncio.wait_for(registration.close(), 1.0)
        os._exit(1)
    log.info("node %s draining (%d requests in flight)", args.node_id, status.num_in_flight)
    status.state = NodeState.DRAINING
    await parts.health.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.NOT_SERVING)
    if registration is not None:
        try:
            await registration.set_state(NodeState.DRAINING)
        except Exception as e:  # etcd down: the router learns it when the stream ends or the lease goes
            log.warning("node %s: could not announce DRAINING in etcd: %s", args.node_id, e)
    try:
        await asyncio.wait_for(status.idle.wait(), args.drain_timeout)
    except asyncio.TimeoutError:
        log.warning("drain timed out with %d requests in flight; aborting them", status.num_in_flight)
    parts.servicer.end_streams()  # what is left is aborted and its blocks released; routers resume it elsewhere
    await parts.warm.on_drain()
    parts.drained = True


async def _shut_down(args: argparse.Namespace, parts: _Parts) -> None:
    """Whatever was started, in order: the server (a grace period after a drain), the engine's step
    thread, block_service's link, the etcd lease. A peer that is away cannot hold the exit up."""
    if parts.server is not None:
        await parts.server.stop(grace=2 if parts.drained else 0)
    if parts.async_engine is not None:
        await asyncio.to_thread(parts.async_engine.shutdown)
    if parts.remote is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(parts.remote.close(), 5.0)
    if parts.registration is not None:
        try:
            await asyncio.wait_for(parts.registration.close(), 5.0)
        except Exception as e:  # etcd down: the lease expires on its own
            log.warning("node %s: could not revoke its etcd lease: %s", args.node_id, e)
    if parts.client is not None:
        await parts.client.close()
    log.info("node %s stopped", args.node_id)


def _serve_metrics(args: argparse.Namespace, node, status, block_size: int) -> None:
    """The metrics endpoint, from the start of the warm-up on (``kvfleet:node_state`` tells)."""
    from functools import partial

    from prometheus_client import CollectorRegistry

    from compute_service.node import metrics
    from kvfleet.metrics_server import LoopCollector, metrics_listen, serve_metrics

    registry = CollectorRegistry()
    read = partial(metrics.sample, node, status, block_size)
    registry.register(LoopCollector(asyncio.get_running_loop(), read, metrics.families))
    serve_metrics(registry, metrics_listen(args.listen, args.metrics_port), f"node {args.node_id}")


