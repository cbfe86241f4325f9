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

from kvfleet.block_service.settings import BlockServiceSettings
from kvfleet.core import settings

log = logging.getLogger("kvfleet.block_service")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_flags(parser, BlockServiceSettings)


def run(args: argparse.Namespace) -> int:
    import sys

    from kvfleet.core import event_loop, tls
    from kvfleet.core.identity import BLOCK_SERVICE_ID
    from kvfleet.core.preflight import PreflightError, check_port_free, check_side_ports_free
    from kvfleet.core.tracing import setup_tracing, shutdown_tracing

    try:
        config = settings.build(BlockServiceSettings, args)
        tls.configure(config.tls, BLOCK_SERVICE_ID, "block_service")
        check_port_free(config.listen)  # before recovering the log, which may take a while
        check_side_ports_free(config.listen, config.metrics_port, config.health_port)
        if config.etcd:
            from kvfleet.core.membership import etcd_client

            etcd_client(config.etcd)  # a URL that is not http://host:port: said now, in one line
    except (PreflightError, ValueError) as e:
        print(f"kvfleet block-service: {e}", file=sys.stderr)
        return 2

    setup_tracing("kvfleet-block-service")  # before the server exists: its RPCs join request traces
    try:
        return event_loop.run(serve(config))
    finally:
        shutdown_tracing()


async def serve(config: BlockServiceSettings) -> int:
    import asyncio
    import signal

    from grpc_health.v1 import health_pb2

    from kvfleet.block_service.durable import DurablePageTable, RecoveryError
    from kvfleet.block_service.eviction import DEFAULT_POLICY
    from kvfleet.block_service.page_table import PageTable
    from kvfleet.block_service.server import BlockManagerServicer, tenant_misfits
    from kvfleet.block_service.tenants import load_tenants_without_keys
    from kvfleet.core import rpc
    from kvfleet.core.health_port import Readiness
    from kvfleet.v1 import block_manager_pb2_grpc

    if config.durability == "off":
        store = DurablePageTable(PageTable(config.eviction.configured() or DEFAULT_POLICY), None)
    else:
        try:
            store, report = DurablePageTable.open(config.state_dir, fsync=config.durability == "fsync",
                                                  eviction=config.eviction.configured())
        except RecoveryError as err:  # never start from a stale state: say why, exit non-zero
            log.error("cannot start: %s", err)
            return 2
        (log.warning if report.stop_reason or report.skipped else log.info)("%s", report.summary())
    tenants = None
    if config.tenants:
        try:
            tenants = load_tenants_without_keys(config.tenants)  # none of the keys reach the disk
        except ValueError as err:  # TenantsFileError: unreadable or invalid, with where and why
            log.error("cannot load tenants from %s: %s", config.tenants, err)
            return 2

    async def configure_tenants() -> None:  # a write: by the one block_service, or by a replica once it leads
        if tenants is not None:
            store.configure_tenants(tenants, replace_all=True)
            await store.flush()
            log.info("configured %d tenants from %s", len(tenants), config.tenants)
            refused, warned = tenant_misfits(store.table, tenants)  # the nodes recovered: logged, not refused
            if refused or warned:
                log.warning("the recovered nodes' pools cannot honour %s: %s", config.tenants, "; ".join(refused + warned))

    replication = _replication(config, store) if config.etcd else None
    if replication is None:
        await configure_tenants()
    metrics = _serve_metrics(config, store)
    server = rpc.server(max_send_bytes=rpc.MAX_MESSAGE_BYTES, interceptors=metrics.interceptors if metrics else [],
                        internal=True)
    servicer = BlockManagerServicer(store, *replication[:3]) if replication else BlockManagerServicer(store)
    block_manager_pb2_grpc.add_BlockManagerServicer_to_server(servicer, server)
    health_servicer = rpc.serve_health_and_reflection(server, "kvfleet.v1.BlockManager")
    if not rpc.bind_internal(server, config.listen):
        log.error("cannot listen on %s", config.listen)
        return 2
    await server.start()
    await health_servicer.set("kvfleet.v1.BlockManager", health_pb2.HealthCheckResponse.SERVING)
    try:
        readiness = await Readiness.start(health_servicer, "kvfleet.v1.BlockManager", config.listen,
                                          config.health_port, config.tls.cert_warn_days, "block_service")
    except OSError as err:
        log.error("%s", err)
        await server.stop(grace=0)
        return 2
    log.info("block_service listening on %s (durability %s, state %s, eviction %s)", config.listen, config.durability,
             config.state_dir, store.table.eviction)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(_snapshot_loop(store, config.snapshot_interval_s, config.snapshot_log_mib)),
             asyncio.create_task(_pin_expiry_loop(store, servicer.role))]
    replica = None
    if replication is not None:
        step_downs = (lambda reason: metrics.step_downs.labels(reason=reason).inc()) if metrics else None
        replica = asyncio.create_task(_run_replica(config, store, replication, configure_tenants, step_downs))
        replica.add_done_callback(lambda _: stop.set())
        tasks.append(replica)
    if config.backup_dir:
        tasks.append(asyncio.create_task(_ship_loop(store, config.backup_dir, config.log_ship_interval)))
        log.info("shipping the log to %s every %.0f s, a full snapshot every %.0f s", config.backup_dir,
                 config.log_ship_interval, config.snapshot_interval_s)
    await stop.wait()
    await readiness.close()
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
    if config.backup_dir:  # the final snapshot too: a restore from the backup replays nothing
        await _ship(store, config.backup_dir)
    log.info("stopped cleanly at log record %d", store.lsn)
    return 0


def _replication(config: BlockServiceSettings, store) -> tuple:
    """``(role, acks, source, rlog)`` of a replica: nobody may write until the election says so."""
    from kvfleet.block_service.lineage import ensure_lineage
    from kvfleet.block_service.replication_log import ReplicationLog
    from kvfleet.block_service.replication_source import ReplicationSource
    from kvfleet.block_service.role import Role
    from kvfleet.block_service.standby_acks import StandbyAcks

    rlog = ReplicationLog.from_state_dir(config.state_dir, store.lsn)
    store.on_durable = rlog.append
    role = Role(holds=lambda: False)
    acks = StandbyAcks(config.sync_standby, config.sync_timeout, lambda: store.durable_lsn)
    source = ReplicationSource(store, rlog, acks, role, lambda: ensure_lineage(config.state_dir))
    return role, acks, source, rlog


async def _run_replica(config: BlockServiceSettings, store, replication: tuple, on_lead, on_step_down) -> int:
    """The replica's life (``replica.Replica``) on its own etcd client; returns an exit code."""
    from kvfleet.block_service.follower import Follower
    from kvfleet.block_service.lineage import reset_interrupted
    from kvfleet.block_service.replica import Replica, ReplicaConfig
    from kvfleet.core.membership import etcd_client

    role, acks, _, rlog = replication
    address = config.advertise or config.listen
    client = etcd_client(config.etcd)  # connects on first use: etcd down at start is retried, not fatal
    spare = etcd_client(config.etcd)   # the lease refreshes' second connection (kvfleet.block_service.election)
    try:
        follower = Follower(store, rlog, config.state_dir, address)
        interrupted = reset_interrupted(config.state_dir)
        if interrupted and not config.standby:
            log.warning("the state in %s was being replaced by a leader's snapshot when this replica stopped: "
                        "it follows a leader before it may lead", config.state_dir)
        replica = ReplicaConfig(address, config.state_dir, config.lease_ttl, config.standby or interrupted)
        return await Replica(client, role, follower, replica, on_lead, acks.can_take_over, on_step_down,
                             acks.wait_alone_for, spare=spare).run()
    finally:
        await client.close()
        await spare.close()


def _serve_metrics(config: BlockServiceSettings, store):
    """With ``--metrics-port``: the metrics endpoint started, the store's log writes observed, and
    the metrics returned with the interceptor that counts operations (for the gRPC server) as
    ``interceptors``; else None."""
    if config.metrics_port is None:
        return None
    import asyncio

    from kvfleet.block_service import metrics
    from kvfleet.core.metrics_server import LoopCollector, metrics_listen, serve_metrics
    from kvfleet.core.rpc_metrics import CallCounter
    from kvfleet.v1 import block_manager_pb2

    m = metrics.BlockServiceMetrics()

    async def read():
        return metrics.sample(store)

    m.registry.register(LoopCollector(asyncio.get_running_loop(), read, metrics.families))
    store.on_write = m.wal_fsync.observe
    serve_metrics(m.registry, metrics_listen(config.listen, config.metrics_port), "block_service")
    methods = block_manager_pb2.DESCRIPTOR.services_by_name["BlockManager"].methods_by_name
    m.interceptors = [CallCounter(m.operations, methods)]
    return m


async def _ship(store, backup_dir: str) -> None:
    from functools import partial

    from kvfleet.block_service.backup import ship

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


async def _pin_expiry_loop(store, role, interval_s: float = 5.0) -> None:
    """The leader ends the pins whose time came, by writing a record (a standby replays it)."""
    import asyncio
    import time

    while True:
        await asyncio.sleep(interval_s)
        if role.holds():
            try:
                if store.expire_pins(time.time()):
                    await store.flush()
            except Exception as err:  # the log failed: every write says so already
                log.warning("pins not expired: %s", err)


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
