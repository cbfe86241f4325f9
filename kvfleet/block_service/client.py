"""An async client of block_service with the page table's own signatures.

``BlockManagerClient`` speaks the same calls as ``PageTable`` (``allocate_many``, ``extend``,
``commit``, ``release``, ``match_prefix``, ...), batched, and raises the same errors
(``kvfleet.core.errors``) for the same status codes, so code written against the core runs against
the service unchanged. Transport failures stay ``grpc.aio.AioRpcError``.

With replicas, ``retarget`` moves the client to another address (the new leader, as
``leader_client`` learns it from etcd); a client with no target yet answers ``Unavailable``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvfleet.block_service import wire
from kvfleet.block_service.blocks_report import BlocksReport, NodeBlocks
from kvfleet.block_service.bookkeeping import ApplyResult
from kvfleet.block_service.node_sync import LiveSequence, SyncResult
from kvfleet.block_service.page_table import SeqState
from kvfleet.block_service.pins import PinResult
from kvfleet.block_service.stats import NodeStats, TenantStats
from kvfleet.core import rpc
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal, TierChange
from kvfleet.core.errors import ERRORS_BY_CODE, Unavailable
from kvfleet.core.identity import BLOCK_SERVICE_ID
from kvfleet.core.tenants import Tenant
from kvfleet.core.tls import Credentials
from kvfleet.v1 import block_manager_pb2 as pb
from kvfleet.v1 import block_manager_pb2_grpc as pb_grpc


class BlockManagerClient:
    def __init__(self, target: str | None, timeout_s: float = 30.0, channel: grpc.aio.Channel | None = None,
                 credentials: Credentials | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._credentials = credentials  # None: this process's (kvfleet.core.tls)
        self._channel = channel or (self._connect(target) if target else None)
        self._stub = pb_grpc.BlockManagerStub(self._channel) if self._channel else None
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        self._closing: set[asyncio.Task] = set()  # old channels being closed (retarget)

    def retarget(self, target: str) -> None:
        """Send the next calls to ``target``; calls under way on the old channel end now, as
        ``Unavailable`` (the old leader may be cut off: waiting out their deadlines would hold up
        every call queued behind them; whether a write there took effect is what a resync settles)."""
        if target == self.target:
            return
        old, self.target = self._channel, target
        self._channel = self._connect(target)
        self._stub = pb_grpc.BlockManagerStub(self._channel)
        if old is not None:
            closing = asyncio.get_running_loop().create_task(old.close())
            self._closing.add(closing)
            closing.add_done_callback(self._closing.discard)

    def _connect(self, target: str) -> grpc.aio.Channel:
        return rpc.channel(target, peer=BLOCK_SERVICE_ID, credentials=self._credentials)

    def on_close(self, close: Callable[[], Awaitable[None]]) -> None:
        """Run ``close()`` when the client closes (what follows the leader for it)."""
        self._on_close.append(close)

    async def __aenter__(self) -> BlockManagerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for close in self._on_close:
            await close()
        if self._channel is not None:
            await self._channel.close()

    async def wait_ready(self, timeout_s: float = 10.0) -> None:
        if self._channel is None:
            raise Unavailable("no block_service leader is named in etcd yet")
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)

    async def ping(self, timeout_s: float, wait_for_ready: bool = False) -> None:
        """One health check of the replica this client targets, on the channel its calls take (so
        it fails as they would; ``wait_for_ready``: it waits for the channel to connect within its
        time instead of failing at once while the channel backs off); raises ``Unavailable`` or the
        transport's ``AioRpcError``."""
        channel = self._channel
        if channel is None:
            raise Unavailable("no block_service leader is named in etcd yet")
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s,
                                                          wait_for_ready=wait_for_ready)
        await self._unless_moved(channel, check)

    async def _unless_moved(self, channel: grpc.aio.Channel, call):
        """``call``'s answer; a call that ``retarget`` cut short by closing ``channel`` (grpc.aio
        raises ``CancelledError`` in its awaiter then, though nobody cancelled the task) raises
        ``Unavailable``, as a call to a leader that went away does."""
        try:
            return await call
        except (asyncio.CancelledError, grpc.aio.AioRpcError) as err:
            cancelled = isinstance(err, asyncio.CancelledError) or err.code() == grpc.StatusCode.CANCELLED
            task = asyncio.current_task()
            if cancelled and channel is not self._channel and task is not None and not task.cancelling():
                raise Unavailable(f"block_service's leader moved to {self.target} during the call") from None
            raise

    async def _call(self, method: str, request):
        stub, channel = self._stub, self._channel
        if stub is None:
            raise Unavailable("no block_service leader is named in etcd yet")
        try:
            return await self._unless_moved(channel, getattr(stub, method)(request, timeout=self.timeout_s))
        except grpc.aio.AioRpcError as err:
            error = ERRORS_BY_CODE.get(err.code().name)
            if error is None:
                raise
            raise error(err.details()) from None

    def follow_log(self, requests):
        """A standby's ``FollowLog`` stream (``follower``): iterate the call for the leader's
        ``LogEntry`` messages; ``requests`` (async iterable) sends where it stands, then its acks."""
        if self._stub is None:
            raise Unavailable("no block_service leader is named in etcd yet")
        return self._stub.FollowLog(requests)

    # ---- the page table's calls ----------------------------------------------------------------

    async def allocate_many(self, requests: Sequence[AllocateRequest]) -> list[Allocation | Refusal]:
        resp = await self._call("AllocateMany", wire.allocate_request_to_pb(requests))
        return wire.allocate_results_from_pb(resp)

    async def allocate(
        self, node_id: str, seq_id: str, tenant: str, block_hashes: Sequence[bytes], num_tokens: int
    ) -> Allocation | Refusal:
        return (await self.allocate_many([AllocateRequest(node_id, seq_id, tenant, block_hashes, num_tokens)]))[0]

    async def extend(self, growth: Sequence[tuple[str, int]], tenant: str | None = None) -> list[list[int] | Refusal]:
        resp = await self._call("ExtendMany", wire.extend_request_to_pb(growth, tenant))
        return wire.extend_results_from_pb(resp)

    async def commit(self, commits: Sequence[tuple[str, int, bytes]], tenant: str | None = None) -> int:
        resp = await self._call("CommitMany", wire.commit_request_to_pb(commits, tenant))
        return resp.num_committed

    async def release(self, seq_ids: Sequence[str], tenant: str | None = None) -> None:
        await self._call("ReleaseMany", pb.ReleaseManyRequest(seq_ids=seq_ids, tenant=tenant or ""))

    async def apply(self, commits: Sequence[tuple[str, int, bytes]], releases: Sequence[str],
                    growth: Sequence[tuple[str, int]], tenant: str | None = None,
                    drops: Sequence[tuple[str, int]] = (), node_id: str = "",
                    tiers: Sequence[TierChange] = ()) -> ApplyResult:
        """``extend`` (``growth``), ``commit``, ``drop_front`` (``drops``), ``release`` and the
        node's lower-tier moves (``tiers``, of ``node_id``) in one call, in that order, item by
        item: a bad item is refused alone and listed in ``ApplyResult.errors``, the rest applied;
        moves past a tenant's lower-tier cap come back in ``ApplyResult.tier_refused``."""
        resp = await self._call("ApplyMany", pb.ApplyManyRequest(
            commits=wire.commit_request_to_pb(commits, tenant),
            releases=pb.ReleaseManyRequest(seq_ids=releases, tenant=tenant or ""),
            growth=wire.extend_request_to_pb(growth, tenant),
            drops=pb.DropManyRequest(sequences=[pb.SequenceDrop(seq_id=s, num_blocks=n) for s, n in drops],
                                     tenant=tenant or ""),
            tiers=wire.tier_changes_to_pb(node_id, tiers) if tiers else None))
        return wire.apply_result_from_pb(resp)

    async def match_prefix(self, block_hashes: Sequence[bytes], node_ids: Sequence[str] | None = None) -> dict[str, int]:
        """Per node, the leading blocks of the prompt in its pool (hot)."""
        return (await self.match_tiers(block_hashes, node_ids))[0]

    async def match_tiers(self, block_hashes: Sequence[bytes],
                          node_ids: Sequence[str] | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """``(hot, lower)``: per node the hot run, and past it the blocks held in a lower tier
        (only nodes holding any)."""
        req = pb.MatchPrefixRequest(block_hashes=b"".join(block_hashes), node_ids=node_ids or [])
        return wire.matches_from_pb(await self._call("MatchPrefix", req))

    async def register_node(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int) -> bool:
        req = pb.RegisterNodeRequest(node_id=node_id, num_blocks=num_blocks, block_size=block_size,
                                     bytes_per_block=bytes_per_block)
        return (await self._call("RegisterNode", req)).created

    async def sync_node(self, node_id: str, num_blocks: int, block_size: int, bytes_per_block: int,
                        listed: Sequence[LiveSequence], tiers: Sequence[TierChange] | None = None) -> SyncResult:
        """Make block_service's view of this node equal to ``listed`` (every live sequence of the
        node), the pool's shape and, given ``tiers``, the node's whole lower-tier index; the answer
        says what was released, adopted, updated, refused."""
        req = wire.sync_request_to_pb(node_id, num_blocks, block_size, bytes_per_block, listed, tiers)
        return wire.sync_result_from_pb(await self._call("SyncNode", req))

    async def deregister_node(self, node_id: str) -> list[str]:
        resp = await self._call("DeregisterNode", pb.DeregisterNodeRequest(node_id=node_id))
        return list(resp.released_seq_ids)

    async def configure_tenants(self, configs: Iterable[Tenant], replace_all: bool = False) -> None:
        req = pb.ConfigureTenantsRequest(tenants=[wire.tenant_to_pb(c) for c in configs], replace_all=replace_all)
        await self._call("ConfigureTenants", req)

    async def stats(self, node_ids: Sequence[str] | None = None) -> tuple[list[NodeStats], list[TenantStats]]:
        resp = await self._call("Stats", pb.BlockStatsRequest(node_ids=node_ids or []))
        return ([wire.node_stats_from_pb(n) for n in resp.nodes],
                [wire.tenant_stats_from_pb(t) for t in resp.tenants])

    async def blocks(self, node_ids: Sequence[str] | None = None, top_holders: int = 5) -> BlocksReport:
        """Who holds the blocks (``kvfleet blocks``): per node its tiers and top holders, per tenant
        its charges; read-only."""
        resp = await self._call("Stats", pb.BlockStatsRequest(node_ids=node_ids or [], top_holders=top_holders))
        nodes = [NodeBlocks(wire.node_stats_from_pb(n), [wire.tier_from_pb(t) for t in n.tiers],
                            [wire.holder_from_pb(h) for h in n.top_holders]) for n in resp.nodes]
        return BlocksReport(nodes, [wire.tenant_stats_from_pb(t) for t in resp.tenants], resp.log_records,
                            [wire.tenant_pins_from_pb(p) for p in resp.pins])

    async def pin_prefix(self, node_id: str, tenant: str, block_hashes: Sequence[bytes], ttl_s: int) -> PinResult:
        """Pin a prompt's leading blocks on a node for ``ttl_s`` seconds (``pins``); refused with
        ``ResourceExhausted`` past the tenant's budget, ``FailedPrecondition`` without one."""
        resp = await self._call("PinPrefix", pb.PinPrefixRequest(
            tenant=tenant, node_id=node_id, block_hashes=b"".join(block_hashes), ttl_s=ttl_s))
        return PinResult(resp.num_pinned, resp.num_new, resp.tenant_pinned, resp.tenant_allowed, int(resp.expires_at))

    async def sequences(self, seq_ids: Sequence[str], tenant: str | None = None) -> list[SeqState]:
        resp = await self._call("GetSequences", pb.GetSequencesRequest(seq_ids=seq_ids, tenant=tenant or ""))
        return [wire.sequence_from_pb(s) for s in resp.sequences]
