"""``kvfleet block-service``: serve the fleet's page table over gRPC, durably.

    kvfleet block-service --listen 127.0.0.1:50051 --state-dir .state/block_service --tenants tenants.yaml

On start it recovers from the state directory (newest snapshot + log, reporting what it applied and
where it stopped). SIGTERM or SIGINT: stop serving, snapshot, exit 0.
"""

from __future__ import annotations

import argparse
import logging

from kvfleet.metrics_server import add_metrics_argument

log = logging.getLogger("block_service")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50051", help="address to serve on (host:port)")
    parser.add_argument("--state-dir", default=".state/block_service", help="snapshots and write-ahead log")
    parser.add_argument("--tenants", metavar="FILE", help="tenants YAML (the router's format); replaces the set")
    parser.add_argument("--durability", choices=("fsync", "write", "off"), default="fsync",
                        help="fsync the log before answering (default), only write it, or keep no log")
    parser.add_argument("--snapshot-interval", "--snapshot-interval-s", dest="snapshot_interval_s",
                        type=duration, default=3600.0, metavar="DURATION",
                        help="a full snapshot this often (seconds, or 30s / 5m / 1h; default 1h)")
    parser.add_argument("--backup-dir", metavar="DIR",
                        help="ship the latest snapshot and the log since to DIR (disaster recovery)")
    parser.add_argument("--log-ship-interval", type=duration, default=300.0, metavar="DURATION",
                        help="ship the log to --backup-dir this often (default 5m)")
    parser.add_argument("--snapshot-log-mib", type=float, default=1024.0,
                        help="also snapshot when the log grows past this size")
    add_metrics_argument(parser)


def duration(text: str) -> float:
    """``3600``, ``90s``, ``5m``, ``1h`` -> seconds (positive)."""
    units = {"s": 1, "m": 60, "h": 3600}
    scale = units.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if text[-1:].lower() in units else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (seconds, or 30s / 5m / 1h)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    import sys

    from kvfleet import event_loop
    from kvfleet.metrics_server import metrics_listen
    from kvfleet.preflight import PreflightError, check_port_free
    from kvfleet.tracing import setup_tracing, shutdown_tracing

    try:
        check_port_free(args.listen)  # before recovering the log, which may take a while
        if args.metrics_port is not None:
            check_port_free(metrics_listen(args.listen, args.metrics_port), "metrics")
    except PreflightError as e:
        print(f"kvfleet block-service: {e}", file=sys.stderr)
        return 2

    setup_tracing("kvfleet-block-service")  # before the server exists: its RPCs join request traces
    try:
        return event_loop.run(serve(args))
    finally:
        shutdown_tracing()


async def serve(args: argparse.Namespace) -> int:
    import asyncio
    import signal

    from grpc_health.v1 import health_pb2

    from block_service.durable import DurablePageTable, RecoveryError
    from block_service.page_table import PageTable
    from block_service.server import BlockManagerServicer
    from block_service.tenants import load_tenants_without_keys
    from kvfleet import rpc
    from kvfleet.v1 import block_manager_pb2_grpc

    if args.backup_dir and args.durability == "off":
        log.error("--backup-dir ships the log: it needs --durability fsync or write")
        return 2
    if args.durability == "off":
        store = DurablePageTable(PageTable(), None)
    else:
        try:
            store, report = DurablePageTable.open(args.state_dir, fsync=args.durability == "fsync")
        except RecoveryError as err:  # never start from a stale state: say why, exit non-zero
            log.error("cannot start: %s", err)
            return 2
        (log.warning if report.stop_reason or report.skipped else log.info)("%s", report.summary())
    if args.tenants:
        try:
            tenants = load_tenants_without_keys(args.tenants)  # none of the keys reach the disk
        except ValueError as err:  # TenantsFileError: unreadable or invalid, with where and why
            log.error("cannot load tenants from %s: %s", args.tenants, err)
            return 2
        store.configure_tenants(tenants, replace_all=True)
        store.sync()
        log.info("configured %d tenants from %s", len(tenants), args.tenants)

    server = rpc.server(max_send_bytes=rpc.MAX_MESSAGE_BYTES, interceptors=_serve_metrics(args, store))
    block_manager_pb2_grpc.add_BlockManagerServicer_to_server(BlockManagerServicer(store), server)
    health_servicer = rpc.serve_health_and_reflection(server, "kvfleet.v1.BlockManager")
    if not server.add_insecure_port(args.listen):
        log.error("cannot listen on %s", args.listen)
        return 2
    await server.start()
    await health_servicer.set("kvfleet.v1.BlockManager", health_pb2.HealthCheckResponse.SERVING)
    log.info("block_service listening on %s (durability %s, state %s)", args.listen, args.durability,
             args.state_dir)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(_snapshot_loop(store, args.snapshot_interval_s, args.snapshot_log_mib))]
    if args.backup_dir:
        tasks.append(asyncio.create_task(_ship_loop(store, args.backup_dir, args.log_ship_interval)))
        log.info("shipping the log to %s every %.0f s, a full snapshot every %.0f s", args.backup_dir,
                 args.log_ship_interval, args.snapshot_interval_s)
    await stop.wait()
    log.info("stopping: draining calls, then snapshot")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.stop(grace=5)
    await store.flush()
    store.close()
    if args.backup_dir:  # the final snapshot too: a restore from the backup replays nothing
        await _ship(store, args.backup_dir)
    log.info("stopped cleanly at log record %d", store.lsn)
    return 0


def _serve_metrics(args: argparse.Namespace, store) -> list:
    """With ``--metrics-port``: the metrics endpoint started, the store's log writes observed, and
    the interceptor that counts operations (for the gRPC server) returned; else nothing."""
    if args.metrics_port is None:
        return []
    import asyncio

    from block_service import metrics
    from kvfleet.metrics_server import LoopCollector, metrics_listen, serve_metrics
    from kvfleet.rpc_metrics import CallCounter
    from kvfleet.v1 import block_manager_pb2

    m = metrics.BlockServiceMetrics()

    async def read():
        return metrics.sample(store)

    m.registry.register(LoopCollector(asyncio.get_running_loop(), read, metrics.families))
    store.on_write = m.wal_fsync.observe
    serve_metrics(m.registry, metrics_listen(args.listen, args.metrics_port), "block_service")
    methods = block_manager_pb2.DESCRIPTOR.services_by_name["BlockManager"].methods_by_name
    return [CallCounter(m.operations, methods)]


async def _ship(store, backup_dir: str) -> None:
    from functools import partial

    from block_service.backup import ship

    try:
        result = await store.run_exclusive(partial(ship, state_dir=store.state_dir, backup_dir=backup_dir,
                                                   fsync=store.fsync))
        log.info("shipped to %s: %s", backup_dir, result.summary())
    except Exception as err:  # the next ship retries from the manifest: nothing shipped is lost
        log.error("log shipping to %s failed: %s: %s", backup_dir, type(err).__name__, err)


async def _ship_loop(store, backup_dir: str, interval_s: float) -> None:
    """Ship at once (a fresh backup holds the state from the start), then every interval; in a
    worker thread, so the event loop keeps answering."""
    import asyncio

    while True:
        await _ship(store, backup_dir)
        await asyncio.sleep(interval_s)


async def _snapshot_loop(store, interval_s: float, log_mib: float) -> None:
    import asyncio
    import time

    while True:
        await asyncio.sleep(min(interval_s, 5.0))
        if time.monotonic() - store.last_snapshot >= interval_s or store.log_bytes >= log_mib * (1 << 20):
            try:
                path = await store.snapshot_async()
                log.info("snapshot %s", path)
            except Exception:
                log.exception("snapshot failed; the log keeps every change meanwhile")
