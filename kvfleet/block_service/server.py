"""The BlockManager gRPC servicer: protobuf in, page-table call, protobuf out.

Each handler converts (``wire``), calls the durable page table, waits for its log record to be
fsynced (group commit: concurrent calls share one fsync), and answers. Errors become status codes in
one place, ``_answers``; a rejected call has changed nothing. ``ApplyMany`` is the exception by
design: it applies item by item and answers each refused item in its response (``bookkeeping``);
only a message that does not decode (a hash of the wrong length) rejects it whole.
"""

from __future__ import annotations

import functools
import logging
import time

import grpc

from kvfleet.block_service import pins, wire
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.replication_source import ReplicationSource
from kvfleet.block_service.role import Role
from kvfleet.block_service.standby_acks import StandbyAcks
from kvfleet.block_service.tenants import PoolShape, configured, pool_misfits
from kvfleet.core import access, access_guard
from kvfleet.core.errors import BlockServiceError, InvalidArgument, PermissionDenied
from kvfleet.v1 import block_manager_pb2 as pb
from kvfleet.v1 import block_manager_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def tenant_misfits(table, tenants, node_ids=None) -> tuple[list[str], list[str]]:
    """``pool_misfits`` of ``tenants`` against the registered nodes' pools (or those named)."""
    stats = map(table.node_stats, table.node_ids() if node_ids is None else node_ids)
    return pool_misfits(tenants, [PoolShape(s.node_id, s.num_blocks, s.bytes_per_block) for s in stats])


def log_misfits(table, node_id: str) -> None:
    """At a node's registration: one line if its pool cannot honour the tenants (nothing refused)."""
    refused, warned = tenant_misfits(table, table.tenants(), [node_id])
    if refused or warned:
        log.warning("node %s registered; its pool cannot honour the tenants file: %s", node_id,
                    "; ".join(refused + warned))

def _answers(handler):
    """Map the page table's errors to gRPC status codes; anything else is a bug: INTERNAL."""

    @functools.wraps(handler)
    async def wrapped(self, request, context: grpc.aio.ServicerContext):
        try:
            return await handler(self, request, context)
        except BlockServiceError as err:
            await context.abort(grpc.StatusCode[err.code], str(err))
        except Exception as err:
            log.exception("%s failed", handler.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")

    return wrapped


def _tenant(request) -> str | None:
    return request.tenant or None


def _seq_ids(request) -> list[str]:
    """Every sequence an Extend/Commit/Release/Drop request (or ApplyMany's parts) names."""
    return [*(g.seq_id for g in request.growth.sequences), *(r.seq_id for r in request.commits.runs),
            *(d.seq_id for d in request.drops.sequences), *request.releases.seq_ids]


class BlockManagerServicer(pb_grpc.BlockManagerServicer):
    """With replicas (``--etcd``), ``role`` says whether this one may write, ``acks`` what an answer
    waits for besides the local fsync, and ``source`` serves the standbys' ``FollowLog``."""

    def __init__(self, store: DurablePageTable, role: Role | None = None, acks: StandbyAcks | None = None,
                 source: ReplicationSource | None = None) -> None:
        self.store = store
        self.role = role or Role()
        self.acks = acks
        self.source = source

    def _own(self, seq_ids) -> None:
        """A node may touch only its own node's sequences (``kvfleet.core.access``, ``own_sequences``)."""
        caller = access_guard.caller()
        if caller is not None and caller.is_node():
            why = access.foreign_sequences(caller, ((s, self.table.node_of(s)) for s in seq_ids))
            if why is not None:
                log.warning("PERMISSION_DENIED %s", why)
                raise PermissionDenied(why)

    @property
    def table(self):
        return self.store.table  # a standby's store may replace it with the leader's snapshot

    async def _durable(self) -> None:
        """Return once the changes made so far may be acknowledged: durable here, on a standby in
        sync when asked to wait for one, and this replica still the leader."""
        target = self.store.lsn
        await self.store.flush()
        if self.acks is not None:
            await self.acks.wait(target)
        self.role.check_writable()

    async def FollowLog(self, request_iterator, context):
        if self.source is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this block_service was started without --etcd: it has no standbys")
        async for entry in self.source.follow(request_iterator, context):
            yield entry

    @_answers
    async def AllocateMany(self, request, context):
        self.role.check_writable()
        results = self.store.allocate_many(wire.allocate_request_from_pb(request))
        await self._durable()
        return wire.allocate_results_to_pb(results)

    @_answers
    async def ExtendMany(self, request, context):
        self.role.check_writable()
        self._own(g.seq_id for g in request.sequences)
        results = self.store.extend(wire.extend_request_from_pb(request), _tenant(request))
        await self._durable()
        return wire.extend_results_to_pb(results)

    @_answers
    async def CommitMany(self, request, context):
        self.role.check_writable()
        self._own(r.seq_id for r in request.runs)
        num_new = self.store.commit(wire.commit_request_from_pb(request), _tenant(request))
        await self._durable()
        return pb.CommitManyResponse(num_committed=num_new)

    @_answers
    async def ReleaseMany(self, request, context):
        self.role.check_writable()
        self._own(request.seq_ids)
        self.store.release(list(request.seq_ids), _tenant(request))
        await self._durable()
        return pb.ReleaseManyResponse()

    @_answers
    async def ApplyMany(self, request, context):
        self.role.check_writable()
        self._own(_seq_ids(request))
        growth = wire.extend_request_from_pb(request.growth)
        commits = wire.commit_request_from_pb(request.commits)
        tenants = {_tenant(part) for part in (request.growth, request.commits, request.drops, request.releases)} - {None}
        if len(tenants) > 1:
            raise InvalidArgument(f"the parts of one ApplyMany name different tenants: {sorted(tenants)}")
        tenant = tenants.pop() if tenants else None
        drops = [(d.seq_id, d.num_blocks) for d in request.drops.sequences]
        tiers = wire.tier_changes_from_pb(request.tiers) if request.HasField("tiers") else None
        result = self.store.apply(growth, commits, list(request.releases.seq_ids), tenant, drops, tiers)
        await self._durable()
        return wire.apply_result_to_pb(result)

    @_answers
    async def MatchPrefix(self, request, context):
        hot, lower = self.table.match_tiers(wire.split_hashes(request.block_hashes), list(request.node_ids))
        return wire.matches_to_pb(hot, lower, self.table.block_size)

    @_answers
    async def PinPrefix(self, request, context):
        """Pins past their time end first (so they stop counting), then the pin (``pins``)."""
        self.role.check_writable()
        ttl = pins.check_ttl(request.ttl_s)
        now = int(time.time())
        self.store.expire_pins(now)
        r = self.store.pin_prefix(request.node_id, request.tenant, wire.split_hashes(request.block_hashes), now + ttl)
        await self._durable()
        return pb.PinPrefixResponse(num_pinned=r.num_pinned, num_new=r.num_new, tenant_pinned=r.tenant_pinned,
                                    tenant_allowed=r.allowed, expires_at=r.expires_at)

    @_answers
    async def RegisterNode(self, request, context):
        self.role.check_writable()
        created = self.store.register_node(request.node_id, request.num_blocks, request.block_size,
                                           request.bytes_per_block)
        await self._durable()
        if created:
            log_misfits(self.table, request.node_id)
        return pb.RegisterNodeResponse(created=created)

    @_answers
    async def SyncNode(self, request, context):
        self.role.check_writable()
        result = self.store.sync_node(*wire.sync_request_from_pb(request))
        await self._durable()
        if result.registered:
            log_misfits(self.table, request.pool.node_id)
        if result.refused:
            log.warning("sync of node %s refused %d sequences: %s", request.pool.node_id, len(result.refused),
                        "; ".join(f"{s!r}: {why}" for s, why in result.refused[:5]))
        return wire.sync_result_to_pb(result)

    @_answers
    async def DeregisterNode(self, request, context):
        self.role.check_writable()
        released = self.store.deregister_node(request.node_id)
        await self._durable()
        return pb.DeregisterNodeResponse(released_seq_ids=released)

    @_answers
    async def ConfigureTenants(self, request, context):
        self.role.check_writable()
        configs = [wire.tenant_from_pb(t) for t in request.tenants]
        refused, warned = tenant_misfits(self.table, configured(self.table.tenants(), configs, request.replace_all))
        if refused:  # a reload that cannot fit is answered, and changes nothing
            raise InvalidArgument(f"tenants not configured: {'; '.join(refused)}")
        self.store.configure_tenants(configs, request.replace_all)
        if warned:
            log.warning("tenants configured; %s", "; ".join(warned))
        await self._durable()
        return pb.ConfigureTenantsResponse()

    @_answers
    async def Stats(self, request, context):
        node_ids = list(request.node_ids) or self.table.node_ids()
        nodes = []
        for n in node_ids:
            stats = self.table.node_stats(n)
            m = wire.node_stats_to_pb(stats)
            m.tiers.extend(wire.tiers_to_pb(stats))
            m.top_holders.extend(wire.holder_to_pb(h) for h in self.table.top_holders(n, request.top_holders))
            nodes.append(m)
        return pb.BlockStatsResponse(
            nodes=nodes,
            tenants=[wire.tenant_stats_to_pb(t) for n in node_ids for t in self.table.tenant_stats(n)],
            log_records=self.store.durable_lsn,
            log_bytes=self.store.log_bytes,
            pins=[wire.tenant_pins_to_pb(p) for p in self.table.pins.summary() if p.node_id in node_ids],
        )

    @_answers
    async def GetSequences(self, request, context):
        tenant = _tenant(request)
        seqs = [self.table.sequence(s) for s in request.seq_ids]
        if tenant is not None and any(s.tenant != tenant for s in seqs):
            raise PermissionDenied(f"a sequence asked for belongs to another tenant than {tenant!r}")
        return pb.GetSequencesResponse(sequences=[wire.sequence_to_pb(s) for s in seqs])
