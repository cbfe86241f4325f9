"""``kvfleet block-service``: serve the fleet's page table over gRPC, durably.

    kvfleet block-service --listen 127.0.0.1:50051 --state-dir .state/block_service --tenants tenants.yaml

On start it recovers from the state directory (newest snapshot + log, reporting what it applied and
where it stopped). SIGTERM or SIGINT: stop serving, snapshot, exit 0.
"""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("block_service")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:50051", help="address to serve on (host:port)")
    parser.add_argument("--state-dir", default=".state/block_service", help="snapshots and write-ahead log")
    parser.add_argument("--tenants", metavar="FILE", help="tenants YAML (the router's format); replaces the set")
    parser.add_argument("--durability", choices=("fsync", "write", "off"), default="fsync",
                        help="fsync the log before answering (default), only write it, or keep no log")
    parser.add_argument("--snapshot-interval-s", type=float, default=3600.0, help="seconds between snapshots")
    parser.add_argument("--snapshot-log-mib", type=float, default=1024.0,
                        help="also snapshot when the log grows past this size")


def run(args: argparse.Namespace) -> int:
    import sys

    from kvfleet import event_loop
    from kvfleet.preflight import PreflightError, check_port_free
    from kvfleet.tracing import setup_tracing, shutdown_tracing

    try:
        check_port_free(args.listen)  # before recovering the log, which may take a while
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

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from block_service.durable import DurablePageTable, RecoveryError
    from block_service.page_table import PageTable
    from block_service.server import BlockManagerServicer
    from block_service.tenants import load_tenants_without_keys
    from kvfleet import rpc
    from kvfleet.v1 import block_manager_pb2_grpc

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

    server = rpc.server(max_send_bytes=rpc.MAX_MESSAGE_BYTES)
    block_manager_pb2_grpc.add_BlockManagerServicer_to_server(BlockManagerServicer(store), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
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
    snapshots = asyncio.create_task(_snapshot_loop(store, args.snapshot_interval_s, args.snapshot_log_mib))
    await stop.wait()
    log.info("stopping: draining calls, then snapshot")
    snapshots.cancel()
    await server.stop(grace=5)
    await store.flush()
    store.close()
    log.info("stopped cleanly at log record %d", store.lsn)
    return 0


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
