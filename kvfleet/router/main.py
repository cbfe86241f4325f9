"""``kvfleet router``: the public Inference service in front of the compute nodes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from kvfleet.core import settings
from kvfleet.router.settings import RouterSettings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_flags(parser, RouterSettings)


async def serve(config: RouterSettings) -> None:
    from kvfleet.core.health_port import Readiness
    from kvfleet.core.membership import etcd_client, watch_nodes
    from kvfleet.router.admission import Admission
    from kvfleet.router.canary_watch import CanaryRouting
    from kvfleet.router.generation import Generations
    from kvfleet.router.model_text import TokenizerSource
    from kvfleet.router.nodes import NodeTable
    from kvfleet.router.prefix_lookup import connect_prefix_lookup
    from kvfleet.router.priority_queue import PriorityQueue, QueueWeights
    from kvfleet.router.relay import Relay
    from kvfleet.router.routing import NodePicker
    from kvfleet.router.server import SERVICE_NAME, build_server, dial_compute
    from kvfleet.router.tenants import TenantDirectory

    tenants = TenantDirectory.from_file(config.tenants)
    queue = PriorityQueue(config.queue_size, tenants.concurrency_limits(),
                          QueueWeights(config.w_paid, config.w_wait, config.wait_scale_s), capacity=config.capacity)
    admission = Admission(queue)
    nodes = NodeTable(dial_compute)
    picker = NodePicker(config.routing)
    prefix = await connect_prefix_lookup(config.block_service, config.etcd)
    relay = Relay(nodes, picker, prefix, stall_timeout_s=config.stall_timeout_s, disagg=config.disagg)
    canary = CanaryRouting()
    request_metrics = _serve_metrics(config, tenants, queue, relay, canary) if config.metrics_port is not None \
        else None
    generations = Generations(tenants, admission, relay, TokenizerSource(nodes, config.model), request_metrics,
                              canary)
    server = await build_server(config.listen, generations, nodes, unix_socket=config.listen_unix,
                                tls=_public_tls(config))
    readiness = await Readiness.start(server.health, SERVICE_NAME, config.listen, config.health_port,
                                      config.tls.cert_warn_days, "router")
    http = None
    if config.http_listen:
        from kvfleet.router.http_door import Door, HttpServer

        http = HttpServer(Door(generations, nodes, config.http_timeout_s), config.http_listen, config.tls_cert,
                          config.tls_key)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def follow_membership(client) -> None:
        async for change in watch_nodes(client):
            await nodes.apply(change)
            if config.capacity is None:  # the fleet's capacity follows the nodes' live caps
                admission.set_capacity(nodes.capacity())
            await server.update_health()
            if change.info is None:
                prefix.node_left(change.node_id)  # released after a grace; retried once block_service answers
            else:
                prefix.node_back(change.node_id)

    async with etcd_client(config.etcd) as client:
        watcher = asyncio.create_task(follow_membership(client))
        canary_watcher = asyncio.create_task(canary.follow(client))  # the split, changed while running
        await server.server.start()
        host = config.listen.rsplit(":", 1)[0]
        log.info("router serving kvfleet.v1.Inference on %s:%d%s (%d tenants)", host, server.port,
                 " over TLS" if config.tls_cert else "", len(tenants))
        if http is not None:
            http.start()
            log.info("router serving the OpenAI-compatible HTTP API on %s://%s:%d/v1", http.scheme,
                     config.http_listen.rsplit(":", 1)[0], http.port)
        if config.port_file:
            with open(config.port_file, "w") as f:
                f.write(str(server.port))
        await stop.wait()
        log.info("router stopping")
        await readiness.close()
        if http is not None:
            await http.stop()
        await server.server.stop(grace=5)
        for task in (watcher, canary_watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await nodes.close()
        await prefix.close()


def _public_tls(config: RouterSettings):
    """Server TLS for the public gRPC door (``--tls-cert``/``--tls-key``), None for plaintext."""
    if not config.tls_cert:
        return None
    import grpc

    return grpc.ssl_server_credentials([(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())])


def _serve_metrics(config: RouterSettings, tenants, queue, relay, canary):
    """The metrics endpoint started (with the canary's per-request outcomes at ``/canary/samples``);
    returns the ``RequestMetrics`` the requests are observed into."""
    import time
    from collections import Counter

    from kvfleet.core.metrics_server import LoopCollector, metrics_listen, read_on_loop, serve_metrics
    from kvfleet.router import metrics

    request_metrics = metrics.RequestMetrics()
    paid_levels = {name: tenants.by_name(name).paid_level for name in tenants.names()}

    async def read() -> metrics.RouterSample:
        waiting = metrics.tenant_queues(queue.waiting(), queue.running_by_tenant(), paid_levels, time.monotonic())
        picker, ready = relay.picker, relay.nodes.ready()
        weights = {n.node_id: picker.tier_weights(n.load()) for n in ready}
        roles = Counter(n.info.role for n in ready)
        return metrics.RouterSample(waiting, dict(picker.decisions), len(ready), queue.capacity, weights,
                                    dict(roles), relay.handovers, relay.handover_seconds.snapshot())

    loop = asyncio.get_running_loop()
    request_metrics.registry.register(LoopCollector(loop, read, metrics.families))

    async def samples() -> dict:
        return canary.samples_json([n.info.group for n in relay.nodes.ready()])

    serve_metrics(request_metrics.registry, metrics_listen(config.listen, config.metrics_port), "router",
                  {"/canary/samples": lambda: read_on_loop(loop, samples)})
    return request_metrics


def preflight(config: RouterSettings) -> None:
    """A taken port, a model directory without a tokenizer, a peer nobody answers at: one line each."""
    from kvfleet.core.preflight import PreflightError, check_port_free, check_side_ports_free, wait_reachable
    check_port_free(config.listen)
    if config.http_listen:
        check_port_free(config.http_listen, "HTTP")
    check_side_ports_free(config.listen, config.metrics_port, config.health_port)
    for flag, path in (("--tls-cert", config.tls_cert), ("--tls-key", config.tls_key)):
        if path and not Path(path).is_file():
            raise PreflightError(f"{flag} {path}: no such file")
    if config.model is not None and not (Path(config.model) / "tokenizer.json").is_file():
        raise PreflightError(f"{config.model} is not a model directory (no tokenizer.json)")
    wait_reachable("etcd", config.etcd, config.dependency_timeout, log.warning)
    if config.block_service and config.block_service != "etcd":
        wait_reachable("block_service", config.block_service, config.dependency_timeout, log.warning)


def run(args: argparse.Namespace) -> int:
    from kvfleet.core import event_loop, tls
    from kvfleet.core.identity import ROUTER_ID
    from kvfleet.core.preflight import PreflightError
    from kvfleet.core.tenants import TenantsFileError
    from kvfleet.core.tracing import setup_tracing, shutdown_tracing
    from kvfleet.router.server import CannotListen

    try:
        router = settings.build(RouterSettings, args)
        tls.configure(router.tls, ROUTER_ID, "router")
        preflight(router)
    except (ValueError, PreflightError) as e:  # a setting's rule; what the machine or a peer says
        print(f"kvfleet router: {e}", file=sys.stderr)
        return 2
    setup_tracing("kvfleet-router")
    try:
        event_loop.run(serve(router))
    except TenantsFileError as e:
        log.error("%s", e)
        return 2
    except CannotListen as e:
        log.error("%s", e)
        return 2
    finally:
        shutdown_tracing()
    return 0
