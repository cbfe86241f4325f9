"""``kvfleet router``: the public Inference service in front of the compute nodes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from kvfleet.metrics_server import add_metrics_argument

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50051", help="host:port to serve on (port 0: any)")
    parser.add_argument("--listen-unix", default=None, metavar="PATH",
                        help="also serve on this Unix domain socket, for clients on the same machine "
                             "(cheaper per streamed message than TCP loopback)")
    parser.add_argument("--http-listen", default=None, metavar="ADDR",
                        help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, ...) on host:port")
    parser.add_argument("--http-timeout-s", type=float, default=600.0,
                        help="an HTTP request still unanswered after this long gets 504")
    parser.add_argument("--etcd", required=True, help="etcd URL, e.g. http://127.0.0.1:2379")
    parser.add_argument("--block-service", default=None,
                        help="block_service host:port (prefix lookups), or 'etcd': the leader elected in --etcd")
    parser.add_argument("--tenants", required=True, help="tenants YAML file")
    parser.add_argument("--model", default=None, help="model directory for the tokenizer "
                        "(default: the one the compute nodes advertise)")
    parser.add_argument("--queue-size", type=int, default=1024, help="waiting requests before shedding")
    parser.add_argument("--capacity", type=int, default=None,
                        help="requests running at once across the cluster (default: the sum of the READY nodes' "
                             "live caps on running sequences, from membership; requests above it wait here, by score)")
    parser.add_argument("--w-paid", type=float, default=0.6, help="queue score weight of the paid level")
    parser.add_argument("--w-wait", type=float, default=0.4, help="queue score weight of the waiting time")
    parser.add_argument("--wait-scale-s", type=float, default=10.0,
                        help="seconds of waiting worth one unit of the queue's wait term (default 10: a request "
                             "is overtaken only by requests that arrive less than 15 s after it)")
    parser.add_argument("--prefix-weight", type=float, default=1.0,
                        help="routing cost of one uncached prompt block, in active blocks")
    parser.add_argument("--lower-tier-hit-weight", type=_share, default=0.5, metavar="L",
                        help="what a prompt block a node holds below its pool (host memory, disk) is worth "
                             "against one in its pool, 0..1 (default 0.5: copying it back costs about half a "
                             "prefill); hot > lower tier > miss for 0 < L < 1")
    parser.add_argument("--decode-block-weight", type=_share, default=0.1, metavar="D",
                        help="a decoding request's KV block in a node's load, against a block still to prefill, "
                             "0..1 (default 0.1: a first token waits on the prefill queued ahead of it; "
                             "1 counts every active block alike)")
    parser.add_argument("--warmup-s", type=float, default=30.0, help="cold-start traffic ramp of a new node")
    parser.add_argument("--hot-spot-ratio", type=float, default=2.0,
                        help="fall back to least loaded above ratio x the least load + margin")
    parser.add_argument("--stall-timeout-s", type=float, default=120.0,
                        help="a node silent this long mid-request counts as failed (the request moves on)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once serving")
    parser.add_argument("--dependency-timeout", type=float, default=60.0,
                        help="seconds to wait at start for etcd (and block_service) to answer before giving up")
    add_metrics_argument(parser)


def _share(text: str) -> float:
    """A number in [0, 1] (argparse's one-line error otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


async def serve(args: argparse.Namespace) -> None:
    from kvfleet.membership import etcd_client, watch_nodes
    from router.admission import Admission
    from router.generation import Generations
    from router.model_text import TokenizerSource
    from router.nodes import NodeTable
    from router.prefix_lookup import connect_prefix_lookup
    from router.priority_queue import PriorityQueue, QueueWeights
    from router.relay import Relay
    from router.routing import NodePicker, RoutingConfig
    from router.server import build_server, dial_compute
    from router.tenants import TenantDirectory

    tenants = TenantDirectory.from_file(args.tenants)
    queue = PriorityQueue(args.queue_size, tenants.concurrency_limits(),
                          QueueWeights(args.w_paid, args.w_wait, args.wait_scale_s), capacity=args.capacity)
    admission = Admission(queue)
    nodes = NodeTable(dial_compute)
    picker = NodePicker(RoutingConfig(prefix_weight=args.prefix_weight, warmup_s=args.warmup_s,
                                      lower_tier_hit_weight=args.lower_tier_hit_weight,
                                      decode_block_weight=args.decode_block_weight,
                                      hot_spot_ratio=args.hot_spot_ratio))
    prefix = await connect_prefix_lookup(args.block_service, args.etcd)
    relay = Relay(nodes, picker, prefix, stall_timeout_s=args.stall_timeout_s)
    request_metrics = _serve_metrics(args, tenants, queue, picker, nodes) if args.metrics_port is not None else None
    generations = Generations(tenants, admission, relay, TokenizerSource(nodes, args.model), request_metrics)
    server = await build_server(args.listen, generations, nodes, unix_socket=args.listen_unix)
    http = None
    if args.http_listen:
        from router.http_door import Door, HttpServer

        http = HttpServer(Door(generations, nodes, args.http_timeout_s), args.http_listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def follow_membership(client) -> None:
        async for change in watch_nodes(client):
            await nodes.apply(change)
            if args.capacity is None:  # the fleet's capacity follows the nodes' live caps
                admission.set_capacity(nodes.capacity())
            await server.update_health()
            if change.info is None:
                await prefix.forget_node(change.node_id)  # retried once block_service answers
            else:
                prefix.node_back(change.node_id)

    async with etcd_client(args.etcd) as client:
        watcher = asyncio.create_task(follow_membership(client))
        await server.server.start()
        host = args.listen.rsplit(":", 1)[0]
        log.info("router serving kvfleet.v1.Inference on %s:%d (%d tenants)", host, server.port, len(tenants))
        if http is not None:
            http.start()
            log.info("router serving the OpenAI-compatible HTTP API on http://%s:%d/v1",
                     args.http_listen.rsplit(":", 1)[0], http.port)
        if args.port_file:
            with open(args.port_file, "w") as f:
                f.write(str(server.port))
        await stop.wait()
        log.info("router stopping")
        if http is not None:
            await http.stop()
        await server.server.stop(grace=5)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await nodes.close()
        await prefix.close()


def _serve_metrics(args: argparse.Namespace, tenants, queue, picker, nodes):
    """The metrics endpoint started; returns the ``RequestMetrics`` the requests are observed into."""
    import time

    from kvfleet.metrics_server import LoopCollector, metrics_listen, serve_metrics
    from router import metrics

    request_metrics = metrics.RequestMetrics()
    paid_levels = {name: tenants.by_name(name).paid_level for name in tenants.names()}

    async def read() -> metrics.RouterSample:
        waiting = metrics.tenant_queues(queue.waiting(), queue.running_by_tenant(), paid_levels, time.monotonic())
        return metrics.RouterSample(waiting, dict(picker.decisions), len(nodes.ready()), queue.capacity)

    request_metrics.registry.register(LoopCollector(asyncio.get_running_loop(), read, metrics.families))
    serve_metrics(request_metrics.registry, metrics_listen(args.listen, args.metrics_port), "router")
    return request_metrics


def preflight(args: argparse.Namespace) -> None:
    """A taken port, a model directory without a tokenizer, a peer nobody answers at: one line each."""
    from kvfleet.metrics_server import metrics_listen
    from kvfleet.preflight import PreflightError, check_port_free, wait_reachable

    if args.capacity is not None and args.capacity < 1:
        raise PreflightError(f"--capacity must be at least 1, got {args.capacity}")
    if not args.wait_scale_s > 0:
        raise PreflightError(f"--wait-scale-s must be positive, got {args.wait_scale_s}")
    check_port_free(args.listen)
    if args.http_listen:
        check_port_free(args.http_listen, "HTTP")
    if args.metrics_port is not None:
        check_port_free(metrics_listen(args.listen, args.metrics_port), "metrics")
    if args.model is not None and not (Path(args.model) / "tokenizer.json").is_file():
        raise PreflightError(f"{args.model} is not a model directory (no tokenizer.json)")
    wait_reachable("etcd", args.etcd, args.dependency_timeout, log.warning)
    if args.block_service and args.block_service != "etcd":
        wait_reachable("block_service", args.block_service, args.dependency_timeout, log.warning)


def run(args: argparse.Namespace) -> int:
    from kvfleet import event_loop
    from kvfleet.preflight import PreflightError
    from kvfleet.tenants import TenantsFileError
    from kvfleet.tracing import setup_tracing, shutdown_tracing
    from router.server import CannotListen

    try:
        preflight(args)
    except PreflightError as e:
        print(f"kvfleet router: {e}", file=sys.stderr)
        return 2
    setup_tracing("kvfleet-router")
    try:
        event_loop.run(serve(args))
    except TenantsFileError as e:
        log.error("%s", e)
        return 2
    except CannotListen as e:
        log.error("%s", e)
        return 2
    finally:
        shutdown_tracing()
    return 0
