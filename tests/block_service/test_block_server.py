"""The gRPC service in-process: the client round-trips the core's calls, every RPC answers bad input
with the right status, and no rejected call changes state."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.node_sync import LiveSequence
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.recovery import recover
from kvfleet.block_service.server import BlockManagerServicer
from kvfleet.block_service.trace import Trace, drive, drive_async
from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal
from kvfleet.core.errors import NotFound
from kvfleet.core.tenants import Tenant
from kvfleet.v1 import block_manager_pb2 as pb
from kvfleet.v1 import block_manager_pb2_grpc as pb_grpc

H = bytes(range(16))
Code = grpc.StatusCode


async def _serving(store: DurablePageTable, body) -> None:
    server = grpc.aio.server()
    pb_grpc.add_BlockManagerServicer_to_server(BlockManagerServicer(store), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with BlockManagerClient(f"127.0.0.1:{port}") as client:
            await body(client)
    finally:
        await server.stop(None)


def serve_and_run(store: DurablePageTable, body) -> None:
    asyncio.run(_serving(store, body))


def test_client_matches_core_call_for_call(tmp_path) -> None:
    """The same trace through the service and through a local core gives the same answers."""
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    mirror = PageTable()

    async def body(client: BlockManagerClient) -> None:
        for target in (client, mirror):
            r = target.register_node("n0", 300, 16, 1 << 16)
            assert (await r if asyncio.iscoroutine(r) else r) is True
        remote, local = Trace(seed=5, tenants=["a", "b"]), Trace(seed=5, tenants=["a", "b"])
        for _ in range(30):
            await drive_async(client, remote.step())
            drive(mirror, local.step())
        assert remote.block_ops == local.block_ops
        assert store.table.to_dict() == mirror.to_dict()
        [node], tenants = await client.stats()
        assert node == mirror.node_stats("n0")
        assert sorted(tenants, key=lambda t: t.tenant) == sorted(mirror.tenant_stats("n0"), key=lambda t: t.tenant)
        live = list(local.live)[:5]
        assert await client.sequences(live) == [mirror.sequence(s) for s in live]
        hashes = local.prefixes[0]
        assert await client.match_prefix(hashes) == mirror.match_prefix(hashes)

    serve_and_run(store, body)
    store.close()


def test_refusals_are_answers_not_errors(tmp_path, caplog) -> None:
    store = DurablePageTable(PageTable(), None)

    async def body(client: BlockManagerClient) -> None:
        await client.register_node("n0", 4, 16, 1 << 20)
        await client.configure_tenants([Tenant("a", quota_mib=2)])
        with caplog.at_level(logging.WARNING):
            ok, quota, pool = await client.allocate_many([
                AllocateRequest("n0", "s1", "a", [], 32), AllocateRequest("n0", "s2", "a", [], 1),
                AllocateRequest("n0", "s3", "b", [], 48),
            ])
        assert isinstance(ok, Allocation)
        assert quota == Refusal("quota", "n0", "a", 1, 2, 2)
        assert pool == Refusal("pool", "n0", "b", 3, 2, 4)
        assert "block_pool exhausted (alloc=2/4) node=n0 tenant=b" in caplog.text

    serve_and_run(store, body)


def _bad_requests() -> list[tuple[str, object, Code]]:
    alloc = pb.SequenceAllocation
    return [
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="nX", seq_id="x", tenant="a")]), Code.NOT_FOUND),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="live", tenant="a")]),
         Code.ALREADY_EXISTS),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="x", tenant="a"),
                                                           alloc(node_id="n0", seq_id="x", tenant="a")]),
         Code.ALREADY_EXISTS),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="x", tenant="a",
                                                                 num_tokens=-1)]), Code.INVALID_ARGUMENT),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="x", tenant="a",
                                                                 num_tokens=1 << 40)]), Code.INVALID_ARGUMENT),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="x", tenant="a",
                                                                 block_hashes=b"abc", num_tokens=16)]),
         Code.INVALID_ARGUMENT),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="x", tenant="a",
                                                                 block_hashes=H + H, num_tokens=32)]),
         Code.INVALID_ARGUMENT),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="", tenant="a")]),
         Code.INVALID_ARGUMENT),
        ("AllocateMany", pb.AllocateManyRequest(sequences=[alloc(node_id="n0", seq_id="x", tenant="")]),
         Code.INVALID_ARGUMENT),
        ("ExtendMany", pb.ExtendManyRequest(sequences=[pb.SequenceGrowth(seq_id="nope", num_tokens=5)]),
         Code.NOT_FOUND),
        ("ExtendMany", pb.ExtendManyRequest(sequences=[pb.SequenceGrowth(seq_id="live", num_tokens=1)]),
         Code.INVALID_ARGUMENT),
        ("ExtendMany", pb.ExtendManyRequest(sequences=[pb.SequenceGrowth(seq_id="live", num_tokens=-5)]),
         Code.INVALID_ARGUMENT),
        ("ExtendMany", pb.ExtendManyRequest(sequences=[pb.SequenceGrowth(seq_id="live", num_tokens=64)] * 2),
         Code.INVALID_ARGUMENT),
        ("ExtendMany", pb.ExtendManyRequest(sequences=[pb.SequenceGrowth(seq_id="live", num_tokens=64)],
                                            tenant="b"), Code.PERMISSION_DENIED),
        # ApplyMany: only a message that does not decode is rejected whole (bad items: per item)
        ("ApplyMany", pb.ApplyManyRequest(commits=pb.CommitManyRequest(runs=[pb.CommitRun(seq_id="live", block_hashes=H[:7])]),
                                          releases=pb.ReleaseManyRequest(seq_ids=["live"])), Code.INVALID_ARGUMENT),
        ("ApplyMany", pb.ApplyManyRequest(releases=pb.ReleaseManyRequest(seq_ids=["live"], tenant="a"),
                                          growth=pb.ExtendManyRequest(tenant="b")), Code.INVALID_ARGUMENT),
        ("CommitMany", pb.CommitManyRequest(runs=[pb.CommitRun(seq_id="nope", block_hashes=H)]), Code.NOT_FOUND),
        ("CommitMany", pb.CommitManyRequest(runs=[pb.CommitRun(seq_id="live", block_hashes=H[:7])]),
         Code.INVALID_ARGUMENT),
        ("CommitMany", pb.CommitManyRequest(runs=[pb.CommitRun(seq_id="live", first_block_index=-1,
                                                               block_hashes=H)]), Code.INVALID_ARGUMENT),
        ("CommitMany", pb.CommitManyRequest(runs=[pb.CommitRun(seq_id="live", first_block_index=2,
                                                               block_hashes=H)]), Code.INVALID_ARGUMENT),
        ("CommitMany", pb.CommitManyRequest(runs=[pb.CommitRun(seq_id="live", block_hashes=bytes(16))]),
         Code.FAILED_PRECONDITION),
        ("CommitMany", pb.CommitManyRequest(runs=[pb.CommitRun(seq_id="live", block_hashes=H)], tenant="b"),
         Code.PERMISSION_DENIED),
        ("ReleaseMany", pb.ReleaseManyRequest(seq_ids=["live", "nope"]), Code.NOT_FOUND),
        ("ReleaseMany", pb.ReleaseManyRequest(seq_ids=["live", "live"]), Code.INVALID_ARGUMENT),
        ("ReleaseMany", pb.ReleaseManyRequest(seq_ids=["live"], tenant="b"), Code.PERMISSION_DENIED),
        ("MatchPrefix", pb.MatchPrefixRequest(block_hashes=H[:15]), Code.INVALID_ARGUMENT),
        ("MatchPrefix", pb.MatchPrefixRequest(block_hashes=H, node_ids=["nX"]), Code.NOT_FOUND),
        ("PinPrefix", pb.PinPrefixRequest(tenant="a", node_id="nX", block_hashes=H, ttl_s=60), Code.NOT_FOUND),
        ("PinPrefix", pb.PinPrefixRequest(tenant="a", node_id="n0", block_hashes=H[:15], ttl_s=60),
         Code.INVALID_ARGUMENT),
        ("PinPrefix", pb.PinPrefixRequest(tenant="a", node_id="n0", block_hashes=H, ttl_s=0), Code.INVALID_ARGUMENT),
        ("PinPrefix", pb.PinPrefixRequest(tenant="a", node_id="n0", block_hashes=H, ttl_s=8 * 86400),
         Code.INVALID_ARGUMENT),
        ("PinPrefix", pb.PinPrefixRequest(tenant="a", node_id="n0", block_hashes=H, ttl_s=60),
         Code.FAILED_PRECONDITION),  # (tenant a has no pinned_mib)
        ("RegisterNode", pb.RegisterNodeRequest(node_id="n1", num_blocks=8, block_size=24, bytes_per_block=1),
         Code.INVALID_ARGUMENT),
        ("RegisterNode", pb.RegisterNodeRequest(node_id="n1", num_blocks=-8, block_size=16, bytes_per_block=1),
         Code.INVALID_ARGUMENT),
        ("RegisterNode", pb.RegisterNodeRequest(node_id="n1", num_blocks=8, block_size=4096, bytes_per_block=1),
         Code.INVALID_ARGUMENT),
        ("RegisterNode", pb.RegisterNodeRequest(node_id="n1", num_blocks=8, block_size=16, bytes_per_block=0),
         Code.INVALID_ARGUMENT),
        ("RegisterNode", pb.RegisterNodeRequest(node_id="", num_blocks=8, block_size=16, bytes_per_block=1),
         Code.INVALID_ARGUMENT),
        ("RegisterNode", pb.RegisterNodeRequest(node_id="n0", num_blocks=9, block_size=16, bytes_per_block=1 << 16),
         Code.ALREADY_EXISTS),
        ("DeregisterNode", pb.DeregisterNodeRequest(node_id="nX"), Code.NOT_FOUND),
        ("SyncNode", pb.SyncNodeRequest(pool=pb.RegisterNodeRequest(node_id="n1", num_blocks=8, block_size=24,
                                                                    bytes_per_block=1)), Code.INVALID_ARGUMENT),
        ("SyncNode", pb.SyncNodeRequest(pool=pb.RegisterNodeRequest(node_id="", num_blocks=8, block_size=16,
                                                                    bytes_per_block=1)), Code.INVALID_ARGUMENT),
        ("ConfigureTenants", pb.ConfigureTenantsRequest(tenants=[pb.TenantQuota(name="")]), Code.INVALID_ARGUMENT),
        ("ConfigureTenants", pb.ConfigureTenantsRequest(tenants=[pb.TenantQuota(name="a", quota_mib=-1)]),
         Code.INVALID_ARGUMENT),
        ("ConfigureTenants", pb.ConfigureTenantsRequest(tenants=[pb.TenantQuota(name="a", quota_mib=float("nan"))]),
         Code.INVALID_ARGUMENT),
        ("ConfigureTenants", pb.ConfigureTenantsRequest(tenants=[pb.TenantQuota(name="a", quota_mib=1,
                                                                                reserved_mib=2)]),
         Code.INVALID_ARGUMENT),
        ("ConfigureTenants", pb.ConfigureTenantsRequest(tenants=[pb.TenantQuota(name="a")] * 2), Code.INVALID_ARGUMENT),
        ("Stats", pb.BlockStatsRequest(node_ids=["nX"]), Code.NOT_FOUND),
        ("GetSequences", pb.GetSequencesRequest(seq_ids=["nope"]), Code.NOT_FOUND),
        ("GetSequences", pb.GetSequencesRequest(seq_ids=["live"], tenant="b"), Code.PERMISSION_DENIED),
    ]


def test_every_rpc_answers_bad_input_and_changes_nothing(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("n0", 16, 16, 1 << 16)
    store.allocate_many([AllocateRequest("n0", "live", "a", [], 20)])
    store.commit([("live", 0, H)])
    store.sync()
    before, lsn = store.table.to_dict(), store.lsn
    cases = _bad_requests()
    streamed = {"FollowLog"}  # a stream between replicas: test_follow_log_needs_replicas
    assert {m for m, _, _ in cases} == set(pb.DESCRIPTOR.services_by_name["BlockManager"].methods_by_name) - streamed

    async def body(client: BlockManagerClient) -> None:
        stub = pb_grpc.BlockManagerStub(client._channel)
        for method, request, code in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await getattr(stub, method)(request)
            assert err.value.code() == code, (method, request, err.value.details())
            assert err.value.details(), method
            assert store.table.to_dict() == before, method
        with pytest.raises(NotFound, match="unknown sequence 'nope'"):  # the client maps codes back
            await client.release(["nope"])

    serve_and_run(store, body)
    assert store.lsn == lsn
    store.close()


def test_follow_log_needs_replicas(tmp_path) -> None:
    """A block_service started without --etcd has no standbys: a FollowLog is refused, changing nothing."""
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)

    async def body(client: BlockManagerClient) -> None:
        async def first():
            yield pb.FollowLogRequest(from_lsn=0, standby_id="test")

        async with BlockManagerClient(client.target) as other:
            stream = other.follow_log(first())
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stream:
                    pass
        assert err.value.code() == Code.FAILED_PRECONDITION
        assert "--etcd" in err.value.details()

    serve_and_run(store, body)
    store.close()


def test_apply_many_is_growth_commit_release_in_that_order(tmp_path) -> None:
    """One call for a node's bookkeeping: the growth comes first, so a commit may name the block the
    node just filled (its reserve); commits come before releases, so a released prefix stays cached;
    what was applied is logged durably."""
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    h0, h1, hb = bytes([1] * 16), bytes([2] * 16), bytes([3] * 16)

    async def body(client: BlockManagerClient) -> None:
        await client.register_node("n0", 8, 16, 1 << 16)
        a, b = await client.allocate_many([AllocateRequest("n0", "a", "t", [], 20),
                                           AllocateRequest("n0", "b", "t", [], 16)])
        assert isinstance(a, Allocation) and isinstance(b, Allocation)
        # block 1 of "a" is full only at the 40 tokens of the growth in the same call
        result = await client.apply(commits=[("a", 0, h0), ("a", 1, h1)], releases=[], growth=[("a", 40)])
        assert result.num_committed == 2 and not result.errors
        [grown] = result.growth
        assert isinstance(grown, list) and len(grown) == 1
        await client.apply(commits=[("b", 0, hb)], releases=["a"], growth=[])
        assert store.table.match_prefix([h0, h1]) == {"n0": 2}  # committed, then released: cached

    serve_and_run(store, body)
    store.close()
    reopened, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    assert reopened.table.match_prefix([hb]) == {"n0": 1} and reopened.table.match_prefix([h0, h1]) == {"n0": 2}
    reopened.close()


def test_apply_many_refuses_a_bad_item_alone(tmp_path) -> None:
    """One commit of a block the sequence does not hold (the node's view ran ahead) used to
    reject the whole bookkeeping batch, so its releases were lost. Now that item alone is refused,
    reported by kind and index, and everything else is applied and logged."""
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    h0, h1 = bytes([1] * 16), bytes([2] * 16)

    async def body(client: BlockManagerClient) -> None:
        await client.register_node("n0", 8, 16, 1 << 16)
        await client.allocate_many([AllocateRequest("n0", s, "t", [], n)
                                    for s, n in (("x", 9), ("y", 32), ("gone", 16), ("gone2", 16))])
        result = await client.apply(commits=[("y", 0, h0), ("x", 1, h1), ("y", 1, h1)],
                                    releases=["gone", "nobody", "gone2"], growth=[("y", 40), ("x", 3)])
        assert result.num_committed == 2
        assert isinstance(result.growth[0], list) and len(result.growth[0]) == 1
        assert [(e.kind, e.index, e.seq_id, e.code) for e in result.errors] == [
            ("growth", 1, "x", "INVALID_ARGUMENT"),
            ("commit", 1, "x", "INVALID_ARGUMENT"),
            ("release", 1, "nobody", "NOT_FOUND"),
        ]
        assert result.growth[1] == result.errors[0]
        assert "block 1 is not one of them" in result.errors[1].message
        assert "unknown sequence 'nobody'" in result.errors[2].message

    serve_and_run(store, body)
    table = store.table
    assert sorted(s.seq_id for s in (table.sequence("x"), table.sequence("y"))) == ["x", "y"]
    assert table.node_stats("n0").num_sequences == 2  # both releases applied
    assert table.match_prefix([h0, h1]) == {"n0": 2} and table.sequence("y").num_tokens == 40
    table.check()
    store.sync()  # crash: the log alone must give the same state
    replayed, report = recover(str(tmp_path))
    assert report.stop_reason is None and replayed.to_dict() == table.to_dict()


def test_sync_node_over_the_wire(tmp_path, caplog) -> None:
    """A node re-registers after block_service lost its registration, then reconciles: its view and
    block_service's agree afterwards (the invariant check holds), durably."""
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)

    async def body(client: BlockManagerClient) -> None:
        await client.register_node("n0", 16, 16, 1 << 16)
        [gone] = await client.allocate_many([AllocateRequest("n0", "gone", "t", [], 20)])
        assert isinstance(gone, Allocation)
        with caplog.at_level(logging.WARNING):
            result = await client.sync_node("n0", 16, 16, 1 << 16, [
                LiveSequence("a", "t", (5, 6), 30), LiveSequence("b", "u", (5,), 16),
                LiveSequence("bad", "u", (77,), 3)])
        assert not result.registered and result.released == ["gone"] and result.adopted == ["a", "b"]
        assert result.refused == [("bad", "block ids [77] are outside the pool of 16 blocks")]
        assert "sync of node n0 refused 1 sequences: 'bad': block ids [77]" in caplog.text
        [a, b] = await client.sequences(["a", "b"])
        assert (a.block_ids, a.num_tokens, b.block_ids) == ([5, 6], 30, [5])
        [node], _ = await client.stats()
        assert node.num_used == 2 and node.num_sequences == 2 and node.counters.reconciled_releases == 1
        await client.deregister_node("n0")  # lost registration: the next sync brings it back
        again = await client.sync_node("n0", 16, 16, 1 << 16, [LiveSequence("a", "t", (5, 6), 30)])
        assert again.registered and again.adopted == ["a"]

    serve_and_run(store, body)
    store.table.check()
    store.sync()
    replayed, report = recover(str(tmp_path))
    assert report.stop_reason is None and replayed.to_dict() == store.table.to_dict()
