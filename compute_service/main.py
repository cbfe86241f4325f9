"""``kvfleet compute``: one compute node, from model load to drained exit.

    load model, size pool → register pool with block_service → serve gRPC, etcd: WARMING
    → warm up → etcd: READY → ... SIGTERM → etcd: DRAINING → running requests finish
    → blocks released → lease revoked → exit 0

A node outlives its peers' trouble: started while block_service is down, it waits for it; when
block_service goes away later, requests that need it wait (or move to another node) and the node
resyncs its pool when it is back; when etcd loses the node's lease, the registration takes a new
one and the pool is synced again. Only its own engine thread dying ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from kvfleet.metrics_server import add_metrics_argument

log = logging.getLogger(__name__)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:0", help="host:port to serve Compute on (port 0: any)")
    parser.add_argument("--advertise", default=None,
                        help="host:port the router should dial (default: --listen with the bound port)")
    parser.add_argument("--model", required=True, help="Hugging Face-format model directory")
    parser.add_argument("--block-service", default=None,
                        help="block_service host:port, or 'etcd': the leader elected in --etcd (with --etcd a "
                             "fixed address is left for the leader too once one is elected); default: an "
                             "in-process page table, for one node alone")
    parser.add_argument("--etcd", default=None, help="etcd URL to register in, e.g. http://127.0.0.1:2379")
    parser.add_argument("--node-id", required=True, help="this node's id in etcd and block_service")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pool (default: a share of free memory)")
    parser.add_argument("--block-size", default="256", help="tokens per block (16-2048, multiple of 16) or chat/code/document")
    parser.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16, or auto: bfloat16 "
                        "on a CPU with native bfloat16 (AMX, AVX512-BF16), else float32")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="KV pool dtype: auto (= --dtype), float32, bfloat16, float16 or fp8_e4m3 "
                             "(float8_e4m3fn with a float32 scale per token and KV head: about half of bfloat16)")
    parser.add_argument("--kv-layout", default="paged", help="paged (default) or contiguous: each sequence reserves "
                        "--max-model-len slots at admission, no prefix sharing (the traditional baseline)")
    parser.add_argument("--max-model-len", type=_positive_int, default=None,
                        help="longest sequence, prompt and output (default and most: the model's context length)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-num-seqs", type=_positive_int, default=64,
                        help="most sequences running at once (the live cap of --p99-itl-target-ms stays below it)")
    parser.add_argument("--p99-itl-target-ms", type=_positive_float, default=None, metavar="MS",
                        help="hold the p99 inter-token latency near MS: every --control-interval-s the live cap "
                             "on running sequences moves x0.9 when over, x1.1 (up to --max-num-seqs) when well "
                             "under; requests above it wait, and the router sees the reduced capacity (default: off)")
    parser.add_argument("--control-interval-s", type=_positive_float, default=2.0, metavar="S",
                        help="seconds between the P99 controller's decisions (default 2; its window is 10 of them)")
    parser.add_argument("--lease-ttl", type=int, default=5, help="etcd lease seconds")
    parser.add_argument("--drain-timeout", type=float, default=60.0, help="seconds to let requests finish on SIGTERM")
    parser.add_argument("--stream-interval", type=_positive_int, default=1,
                        help="tokens per streamed chunk (default 1: every token as soon as it exists)")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0,
                        help="an idle node holds its first step while requests keep arriving less than this "
                             "many ms apart (at most 10 times it), so a burst is scheduled as one batch (default "
                             "5: a burst's requests reach a busy router's node up to ~5 ms apart); 0: off")
    parser.add_argument("--reconcile-interval", type=_positive_float, default=30.0,
                        help="seconds between reconciliations of this node's blocks with block_service "
                             "(block_service releases what the node no longer holds; default 30)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once READY")
    add_metrics_argument(parser)
    parser.add_argument("--dependency-timeout", type=_positive_float, default=60.0,
                        help="seconds to wait at start for etcd and block_service to answer before giving up "
                             "(default 60; once started, the node waits for them as long as it takes)")


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
    from compute_service.engine import EngineConfig, LLMEngine
    from kvfleet.preflight import PreflightError

    config = EngineConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, dtype=args.dtype,
                          kv_cache_dtype=args.kv_cache_dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                          node_id=args.node_id, kv_layout=args.kv_layout, max_model_len=args.max_model_len)
    try:
        return LLMEngine(args.model, config, allocator_factory=remote)
    except ValueError as e:  # the pool cannot hold what the flags ask (one block, one reservation)
        raise PreflightError(str(e)) from None


def _live_cap(args: argparse.Namespace, engine):
    """The P99 batch controller over the engine's scheduler; None without a target."""
    if args.p99_itl_target_ms is None:
        return None
    import time

    from compute_service.batch_controller import BatchController, ControllerConfig
    from compute_service.live_cap import LiveCap

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
    from compute_service.node_context import EarlyBlocks

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
    from grpc_health.v1 import health_pb2

    from compute_service.async_engine import AsyncEngine
    from compute_service.node_context import NodeContext, NodeStatus
    from compute_service.server import ComputeServicer, warm_up
    from kvfleet import rpc
    from kvfleet.membership import NodeInfo, NodeRegistration, NodeState, etcd_client
    from kvfleet.v1 import compute_pb2_grpc

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    # etcd first (WARMING, pool size unknown yet), block_service second: a previous run's lease
    # expiring can then no longer make the router drop the pool this run is about to register.
    client = etcd_client(args.etcd) if args.etcd else None
    registration = None
    if client is not None:
        await client.connect()
        info = NodeInfo(args.node_id, args.advertise or "", str(args.model), 0, 0, NodeState.WARMING)
        registration = NodeRegistration(client, info, ttl=args.lease_ttl)
        await registration.start()

    remote = None
    if args.block_service:
        from compute_service.block_registration import RemoteAllocatorFactory

        remote = await _unless_stopped(RemoteAllocatorFactory.connect(args.block_service, args.node_id, loop, args.etcd),
                                       stop)
        if remote is None:  # Ctrl-C or SIGTERM while waiting for block_service: nothing was served
            log.info("node %s stopped while waiting for block_service", args.node_id)
            if registration is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(registration.close(), 2.0)
                await client.close()
            return
    engine = await asyncio.to_thread(_build_engine, args, remote)
    allocator = engine.allocator
    model_config = engine.model_config
    live_cap = _live_cap(args, engine)
    async_engine = AsyncEngine(engine, batch_wait_s=args.batch_wait_ms / 1000,
                               after_step=live_cap.after_step if live_cap is not None else None)
    if remote is not None:  # sequences block_service would not hold after a sync move to other nodes
        allocator.on_refused = lambda seq_ids, why: [async_engine.fail(s, why) for s in seq_ids]
    status = NodeStatus(args.node_id, block_rpcs=lambda: getattr(allocator, "num_rpcs", 0),
                        reconciled=lambda: allocator.link.num_reconciled if remote is not None else 0)
    node = NodeContext(status, async_engine, allocator.block_size, args.stream_interval,
                       _early_blocks(remote, engine))

    if args.metrics_port is not None:
        _serve_metrics(args, node, status, allocator.block_size)
    server = rpc.server()
    servicer = ComputeServicer(node)
    compute_pb2_grpc.add_ComputeServicer_to_server(servicer, server)
    # "" answers while the process does (liveness); kvfleet.v1.Compute is SERVING while READY
    health_servicer = rpc.serve_health_and_reflection(server, "kvfleet.v1.Compute")
    await health_servicer.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(args.listen)
    await server.start()
    address = args.advertise or f"{args.listen.rsplit(':', 1)[0]}:{port}"
    if registration is not None:
        await registration.update(address=address, num_blocks=allocator.num_blocks, block_size=allocator.block_size,
                                  max_num_seqs=live_cap.cap if live_cap is not None else args.max_num_seqs)
    seconds = await warm_up(async_engine, args.node_id, block_size=allocator.block_size,
                            max_model_len=engine.max_model_len, vocab_size=model_config.vocab_size)
    status.state = NodeState.READY
    if registration is not None:
        await registration.set_state(NodeState.READY)
    await health_servicer.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.SERVING)
    log.info("node %s READY on %s after a %.1fs warm-up (%d blocks of %d tokens)", args.node_id, address,
             seconds, allocator.num_blocks, allocator.block_size)
    if args.port_file:
        with open(args.port_file, "w") as f:
            f.write(str(port))

    watchdog = asyncio.create_task(_watch_engine(async_engine, stop))
    lease_watch = None
    cap_publisher = None
    if live_cap is not None and registration is not None:
        cap_publisher = asyncio.create_task(_publish_cap(registration, live_cap, max(args.control_interval_s, 1.0)))
    if remote is not None:
        allocator.syncs.start_reconciling(args.reconcile_interval)
        if registration is not None:
            lease_watch = asyncio.create_task(_resync_on_new_lease(registration, allocator))
    await stop.wait()
    watchdog.cancel()
    for task in (lease_watch, cap_publisher):
        if task is not None:
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
    await health_servicer.set("kvfleet.v1.Compute", health_pb2.HealthCheckResponse.NOT_SERVING)
    if registration is not None:
        try:
            await registration.set_state(NodeState.DRAINING)
        except Exception as e:  # etcd down: the router learns it when the stream ends or the lease goes
            log.warning("node %s: could not announce DRAINING in etcd: %s", args.node_id, e)
    try:
        await asyncio.wait_for(status.idle.wait(), args.drain_timeout)
    except asyncio.TimeoutError:
        log.warning("drain timed out with %d requests in flight; aborting them", status.num_in_flight)
    servicer.end_streams()  # what is left is aborted and its blocks released; routers resume it elsewhere
    await server.stop(grace=2)
    await asyncio.to_thread(async_engine.shutdown)
    if remote is not None:
        await remote.close()
    if registration is not None:
        try:
            await registration.close()
        except Exception as e:  # etcd down: the lease expires on its own
            log.warning("node %s: could not revoke its etcd lease: %s", args.node_id, e)
        await client.close()
    log.info("node %s stopped", args.node_id)


def _serve_metrics(args: argparse.Namespace, node, status, block_size: int) -> None:
    """The metrics endpoint, from the start of the warm-up on (``kvfleet:node_state`` tells)."""
    from functools import partial

    from prometheus_client import CollectorRegistry

    from compute_service import metrics
    from kvfleet.metrics_server import LoopCollector, metrics_listen, serve_metrics

    registry = CollectorRegistry()
    read = partial(metrics.sample, node, status, block_size)
    registry.register(LoopCollector(asyncio.get_running_loop(), read, metrics.families))
    serve_metrics(registry, metrics_listen(args.listen, args.metrics_port), f"node {args.node_id}")


def preflight(args: argparse.Namespace) -> None:
    """What a person can get wrong, answered before the model loads: the KV cache dtype (a known
    name, FP8 where this torch and device hold it), the port, the model directory, the peers'
    addresses (waited for a while: they may be starting too)."""
    import torch

    from compute_service.cpu_host import host_cpu_flags, resolve_dtype
    from compute_service.kv_layout import parse_kv_layout
    from compute_service.kv_pool import kv_cache_dtype
    from compute_service.model_config import ModelConfig
    from kvfleet.leader import FROM_ETCD
    from kvfleet.metrics_server import metrics_listen
    from kvfleet.preflight import PreflightError, check_port_free, wait_reachable

    try:
        args.dtype = resolve_dtype(args.dtype, torch.device(args.device).type, host_cpu_flags())
        kv_cache_dtype(args.kv_cache_dtype, args.dtype, torch.device(args.device))
        parse_kv_layout(args.kv_layout)
    except (ValueError, RuntimeError) as e:  # RuntimeError: a device torch cannot use
        raise PreflightError(str(e)) from None
    check_port_free(args.listen)
    if args.metrics_port is not None:
        check_port_free(metrics_listen(args.listen, args.metrics_port), "metrics")
    ModelConfig.from_dir(args.model)
    if args.etcd:
        wait_reachable("etcd", args.etcd, args.dependency_timeout, log.warning)
    if args.block_service == FROM_ETCD and not args.etcd:
        raise PreflightError("--block-service etcd needs --etcd: the block_service leader is elected there")
    if args.block_service and args.block_service != FROM_ETCD:
        wait_reachable("block_service", args.block_service, args.dependency_timeout, log.warning)


def run(args: argparse.Namespace) -> int:
    from compute_service.model_config import ModelLoadError
    from kvfleet import event_loop
    from kvfleet.preflight import PreflightError
    from kvfleet.tracing import setup_tracing, shutdown_tracing

    try:
        preflight(args)
    except (PreflightError, ModelLoadError) as e:
        print(f"kvfleet compute: {e}", file=sys.stderr)
        return 2
    setup_tracing("kvfleet-compute")
    try:
        event_loop.run(serve(args))
    except (ModelLoadError, PreflightError) as e:  # found while loading the weights or sizing the pool
        print(f"kvfleet compute: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()
    return 0
