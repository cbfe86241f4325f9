"""``kvfleet block-service``: serve the fleet's page table over gRPC, durably.

    kvfleet block-service --listen 127.0.0.1:50051 --state-dir .state/block_service --tenants tenants.yaml

On start it recovers from the state directory (newest snapshot + log, reporting what it applied and
where it stopped). SIGTERM or SIGINT: stop serving, snapshot, exit 0.

Two replicas (``--etcd``; README "Two replicas"): each campaigns for the etcd leader key; the
holder serves writes, the other follows its log as a standby and takes over when the leader's lease
lapses (``replica.py``). Without ``--etcd`` it is the one block_service, as before.
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
    parser.add_argument("--etcd", default=None, metavar="URL",
                        help="run as one of several replicas: elect the leader in this etcd (http://host:port)")
    parser.add_argument("--advertise", default=None, metavar="HOST:PORT",
                        help="the address the other replicas and the clients reach this one at "
                             "(default: --listen)")
    parser.add_argument("--standby", action="store_true",
                        help="with --etcd: start as a standby; campaign only after following a leader once")
    parser.add_argument("--sync-standby", action="store_true",
                        help="with --etcd: acknowledge a change only once a standby in sync holds it too "
                             "(none in sync: acknowledged once durable here, with a WARNING)")
    parser.add_argument("--sync-timeout", type=duration, default=2.0, metavar="DURATION",
                        help="the most a change waits for the standby before it falls out of sync (default 2s)")
    parser.add_argument("--lease-ttl", type=int, default=5,
                        help="with --etcd: the leader lease in seconds; a dead leader is replaced within it")
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
        if args.etcd:
            from kvfleet.membership import etcd_client

            etcd_client(args.etcd)  # a URL that is not http://host:port: said now, in one line
    except (PreflightError, ValueError) as e:
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
    if args.etcd and args.durability == "off":
        log.error("--etcd replicates the log: it needs --durability fsync or write")
        return 2
    if not args.etcd and (args.standby or args.sync_standby):
        log.error("--standby and --sync-standby need --etcd (the replicas elect their leader there)")
        return 2
    if args.etcd and args.lease_ttl < 2:
        log.error("--lease-ttl must be at least 2 seconds, got %d", args.lease_ttl)
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
    tenants = None
    if args.tenants:
        try:
            tenants = load_tenants_without_keys(args.tenants)  # none of the keys reach the disk
        except ValueError as err:  # TenantsFileError: unreadable or invalid, with where and why
            log.error("cannot load tenants from %s: %s", args.tenants, err)
            return 2

    async def configure_tenants() -> None:  # a write: by the one block_service, or by a replica once it leads
        if tenants is not None:
            store.configure_tenants(tenants, replace_all=True)
            await store.flush()
            log.info("configured %d tenants from %s", len(tenants), args.tenants)

    replication = _replication(args, store) if args.etcd else None
    if replication is None:
        await configure_tenants()
    server = rpc.server(max_send_bytes=rpc.MAX_MESSAGE_BYTES, interceptors=_serve_metrics(args, store))
    servicer = BlockManagerServicer(store, *replication[:3]) if replication else BlockManagerServicer(store)
    block_manager_pb2_grpc.add_BlockManagerServicer_to_server(servicer, server)
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
    replica = None
    if replication is not None:
        replica = asyncio.create_task(_run_replica(args, store, *replication[::3], configure_tenants))
        replica.add_done_callback(lambda _: stop.set())
        tasks.append(replica)
    if args.backup_dir:
        tasks.append(asyncio.create_task(_ship_loop(store, args.backup_dir, args.log_ship_interval)))
        log.info("shipping the log to %s every %.0f s, a full snapshot every %.0f s", args.backup_dir,
                 args.log_ship_interval, args.snapshot_interval_s)
    await stop.wait()
    code = 0
    if replica is not None and replica.done() and not replica.cancelled():
        if replica.exception() is not None:
            log.error("the replica stopped: %s: %s", type(replica.exception()).__name__, replica.exception())
            code = 1
        else:
            code = replica.result()
    if code:
        await server.stop(grace=0)
        store.close()
        return code
    log.info("stopping: draining calls, then snapshot")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # a leader resigns: its standby takes over now
    await server.stop(grace=5)
    await store.flush()
    store.close()
    if args.backup_dir:  # the final snapshot too: a restore from the backup replays nothing
        await _ship(store, args.backup_dir)
    log.info("stopped cleanly at log record %d", store.lsn)
    return 0


def _replication(args: argparse.Namespace, store) -> tuple:
    """``(role, acks, source, rlog)`` of a replica: nobody may write until the election says so."""
    from block_service.lineage import ensure_lineage
    from block_service.replication_log import ReplicationLog
    from block_service.replication_source import ReplicationSource
    from block_service.role import Role
    from block_service.standby_acks import StandbyAcks

    rlog = ReplicationLog.from_state_dir(args.state_dir, store.lsn)
    store.on_durable = rlog.append
    role = Role(holds=lambda: False)
    acks = StandbyAcks(args.sync_standby, args.sync_timeout, lambda: store.durable_lsn)
    source = ReplicationSource(store, rlog, acks, role, lambda: ensure_lineage(args.state_dir))
    return role, acks, source, rlog


async def _run_replica(args: argparse.Namespace, store, role, rlog, on_lead) -> int:
    """The replica's life (``replica.Replica``) on its own etcd client; returns an exit code."""
    from block_service.follower import Follower
    from block_service.lineage import reset_interrupted
    from block_service.replica import Replica, ReplicaConfig
    from kvfleet.membership import etcd_client

    address = args.advertise or args.listen
    client = etcd_client(args.etcd)  # connects on first use: etcd down at start is retried, not fatal
    try:
        follower = Follower(store, rlog, args.state_dir, address)
        interrupted = reset_interrupted(args.state_dir)
        if interrupted and not args.standby:
            log.warning("the state in %s was being replaced by a leader's snapshot when this replica stopped: "
                        "it follows a leader before it may lead", args.state_dir)
        config = ReplicaConfig(address, args.state_dir, args.lease_ttl, args.standby or interrupted)
        return await Replica(client, role, follower, config, on_lead).run()
    finally:
        await client.close()


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
