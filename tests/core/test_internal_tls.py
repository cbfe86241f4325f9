"""Mutual TLS and the access table on a real BlockManager server (in this process, over loopback):
who gets in at the handshake, and what each identity may call once in."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

import grpc
import pytest

from kvfleet.block_service.client import BlockManagerClient
from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.server import BlockManagerServicer
from kvfleet.core import certs, rpc, tls
from kvfleet.core.allocator import AllocateRequest, Allocation
from kvfleet.core.errors import PermissionDenied
from kvfleet.core.identity import ADMIN_ID, BLOCK_SERVICE_ID, ROUTER_ID, Identity
from kvfleet.core.tenants import Tenant
from kvfleet.v1 import block_manager_pb2 as pb
from kvfleet.v1 import block_manager_pb2_grpc as pb_grpc

N0, N1 = Identity.node("n0"), Identity.node("n1")
BLOCK = 16


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    certs.ensure(root, [BLOCK_SERVICE_ID, ROUTER_ID, ADMIN_ID, N0, N1])
    return root


def creds(certs_dir, identity: Identity) -> tls.Credentials:
    return tls.Credentials.load(certs.identity_dir(certs_dir, identity), identity)


def serve_and_run(certs_dir, body):
    """Run ``await body(address)`` against a block_service under mutual TLS as block-service."""
    async def main():
        tls.use(creds(certs_dir, BLOCK_SERVICE_ID))
        try:
            server = rpc.server(internal=True)
            pb_grpc.add_BlockManagerServicer_to_server(BlockManagerServicer(DurablePageTable(PageTable(), None)), server)
            rpc.serve_health_and_reflection(server, "kvfleet.v1.BlockManager")
            port = rpc.bind_internal(server, "127.0.0.1:0")
            await server.start()
        finally:
            tls.use(None)  # the clients below say whose credentials they use
        try:
            await body(f"127.0.0.1:{port}")
        finally:
            await server.stop(grace=0)
    asyncio.run(main())


def client(certs_dir, address: str, identity: Identity) -> BlockManagerClient:
    return BlockManagerClient(address, timeout_s=5, credentials=creds(certs_dir, identity))


async def refused_at_handshake(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    options = [("grpc.ssl_target_name_override", BLOCK_SERVICE_ID.host_name)]
    channel = grpc.aio.insecure_channel(address) if credentials is None else \
        grpc.aio.secure_channel(address, credentials, options=options)
    async with channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await pb_grpc.BlockManagerStub(channel).Stats(pb.BlockStatsRequest(), timeout=5)
    return err.value.code()


def test_a_caller_without_a_certificate_of_the_cluster_ca_never_reaches_a_method(certs_dir, tmp_path):
    other = tmp_path / "other-ca"
    certs.ensure(other, [ADMIN_ID])  # a certificate that names admin, from another CA
    foreign = creds(other, ADMIN_ID)
    ca = (certs_dir / "ca" / certs.CA_FILE).read_bytes()
    # the expired certificate is of the cluster's own CA: issue it there, beside the good ones
    expired = certs.issue(certs_dir, Identity.node("old"), days=1,
                          not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3))

    async def body(address):
        assert await refused_at_handshake(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext
        no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
        assert await refused_at_handshake(address, no_cert) == grpc.StatusCode.UNAVAILABLE
        other_ca = grpc.ssl_channel_credentials(ca, foreign.key, foreign.cert)
        assert await refused_at_handshake(address, other_ca) == grpc.StatusCode.UNAVAILABLE
        old = grpc.ssl_channel_credentials(ca, (expired / certs.KEY_FILE).read_bytes(),
                                           (expired / certs.CERT_FILE).read_bytes())
        assert await refused_at_handshake(address, old) == grpc.StatusCode.UNAVAILABLE
        async with client(certs_dir, address, ADMIN_ID) as admin:  # and the right one gets in
            assert await admin.stats() == ([], [])

    serve_and_run(certs_dir, body)


def test_a_client_insists_on_the_identity_it_expects_at_the_other_end(certs_dir):
    async def body(address):
        # a router dialling "node n0" at an address where block-service answers
        channel = rpc.channel(address, peer=N0, credentials=creds(certs_dir, ROUTER_ID))
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await pb_grpc.BlockManagerStub(channel).Stats(pb.BlockStatsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

    serve_and_run(certs_dir, body)


def test_only_admin_configures_tenants_and_a_refusal_names_who_and_what(certs_dir, caplog):
    raised = Tenant("small", quota_mib=100 * 1024, paid_level=9, max_concurrent=1000)

    async def body(address):
        for identity in (ROUTER_ID, N0, BLOCK_SERVICE_ID):
            async with client(certs_dir, address, identity) as c:
                with pytest.raises(PermissionDenied, match="may not call .*ConfigureTenants"):
                    await c.configure_tenants([raised])
        async with client(certs_dir, address, ADMIN_ID) as admin:
            await admin.configure_tenants([raised])

    with caplog.at_level(logging.WARNING, logger="kvfleet.core.access_guard"):
        serve_and_run(certs_dir, body)
    lines = [r.getMessage() for r in caplog.records if "PERMISSION_DENIED" in r.getMessage()]
    assert any(line.startswith("PERMISSION_DENIED router calling /kvfleet.v1.BlockManager/ConfigureTenants")
               for line in lines), lines


def test_a_node_writes_only_its_own_pool_and_sequences(certs_dir):
    async def body(address):
        async with client(certs_dir, address, N0) as n0, client(certs_dir, address, N1) as n1:
            assert await n0.register_node("n0", 64, BLOCK, 1024)
            with pytest.raises(PermissionDenied, match="may not act for node 'n1'"):
                await n0.register_node("n1", 64, BLOCK, 1024)
            assert await n1.register_node("n1", 64, BLOCK, 1024)
            ask = AllocateRequest("n1", "s1", "t", [], 3 * BLOCK)
            with pytest.raises(PermissionDenied, match="may not act for node 'n1'"):
                await n0.allocate_many([ask])
            [granted] = await n1.allocate_many([ask])
            assert isinstance(granted, Allocation)
            for attempt in (lambda: n0.release(["s1"]), lambda: n0.extend([("s1", 5 * BLOCK)]),
                            lambda: n0.commit([("s1", 0, b"\x01" * 16)])):
                with pytest.raises(PermissionDenied, match="sequences of another node: 's1'"):
                    await attempt()
            with pytest.raises(PermissionDenied, match="may not act for node 'n1'"):
                await n0.deregister_node("n1")
            with pytest.raises(PermissionDenied, match="must name its own node"):
                await n0.stats()  # every node's figures: the router's and admin's, not a node's
            [mine], _ = await n0.stats(["n0"])
            assert mine.node_id == "n0"
            await n1.release(["s1"])  # its own: fine
        async with client(certs_dir, address, ADMIN_ID) as admin:
            nodes, _ = await admin.stats()
            assert {n.node_id: n.num_used for n in nodes} == {"n0": 0, "n1": 0}
            assert await admin.deregister_node("n1") == []

    serve_and_run(certs_dir, body)


def test_only_a_block_service_replica_follows_the_log(certs_dir):
    async def body(address):
        for identity in (N0, ROUTER_ID, ADMIN_ID):
            channel = rpc.channel(address, peer=BLOCK_SERVICE_ID, credentials=creds(certs_dir, identity))
            async with channel:
                call = pb_grpc.BlockManagerStub(channel).FollowLog(iter([pb.FollowLogRequest()]), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, identity

    serve_and_run(certs_dir, body)
