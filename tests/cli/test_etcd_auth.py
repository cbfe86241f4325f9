"""etcd under mutual TLS with the fleet's users and roles, against a real etcd (``--client-cert-auth``):
each identity reaches what its role grants and nothing else, and a client without a certificate of
the cluster CA is refused at the handshake."""

from __future__ import annotations

import asyncio
import dataclasses

import aetcd
import grpc
import pytest
from aetcd import rpc

from kvfleet.block_service.durable_mark import DURABLE_KEY, read_mark
from kvfleet.block_service.election import Election
from kvfleet.cli import cli
from kvfleet.cli.etcd_auth import READ, READWRITE, Grant, apply, enable, prefix_grant, roles
from kvfleet.cli.etcd_server import EtcdServer
from kvfleet.core import certs, tls
from kvfleet.core.identity import ADMIN_ID, BLOCK_SERVICE_ID, ETCD_ID, ROUTER_ID, Identity
from kvfleet.core.leader import Leader, read_leader
from kvfleet.core.membership import MembershipChange, NodeInfo, NodeRegistration, NodeState, etcd_client, watch_nodes
from kvfleet.core.tls import Credentials

NODE_0, NODE_1, NODE_2 = (Identity.node(f"node-{i}") for i in range(3))


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("certs")
    certs.ensure(where, [ADMIN_ID, ETCD_ID, ROUTER_ID, BLOCK_SERVICE_ID, NODE_0, NODE_1, NODE_2])
    return where


@pytest.fixture(scope="module")
def etcd(certs_dir, tmp_path_factory):
    server = EtcdServer(data_dir=tmp_path_factory.mktemp("etcd"), certs_dir=certs_dir).start()
    try:
        applied = enable(server.url, creds(certs_dir, ADMIN_ID), ["node-0", "node-1"])
        assert applied.enabled_now and "node:node-0" in applied.users_added
        yield server
    finally:
        server.stop()


def creds(certs_dir, identity: Identity) -> Credentials:
    return Credentials.load(certs.identity_dir(certs_dir, identity), identity)


def client_as(etcd, certs_dir, identity: Identity) -> aetcd.Client:
    return etcd_client(etcd.url, timeout=5, credentials=creds(certs_dir, identity))


def node_info(node_id: str) -> NodeInfo:
    return NodeInfo(node_id, "127.0.0.1:7001", "/models/tiny", 64, 16, NodeState.WARMING)


def test_the_roles_table():
    table = roles(["node-0"])
    assert prefix_grant("/kvfleet/", READ) == Grant(b"/kvfleet/", b"/kvfleet0", READ)
    assert table["router"] == {prefix_grant("/kvfleet/", READ)}
    assert prefix_grant("/kvfleet/block_service/", READWRITE) in table["block-service"]
    assert Grant(b"/kvfleet/nodes/node-0", b"", READWRITE) in table["node:node-0"]  # its key alone
    assert Grant(b"/kvfleet/block_service/unreachable/node-0", b"", READWRITE) in table["node:node-0"]  # its complaint
    with pytest.raises(ValueError, match="node id"):
        roles(["bad id"])


def test_https_without_credentials_is_one_clear_error():
    before = tls.current()
    tls.use(None)
    try:
        with pytest.raises(ValueError, match="speaks TLS, and this process has no certificate"):
            etcd_client("https://127.0.0.1:2379")
    finally:
        tls.use(before)


def test_a_node_registers_and_the_router_watches_it_come_and_go(etcd, certs_dir):
    async def main() -> None:
        async with client_as(etcd, certs_dir, ROUTER_ID) as router, client_as(etcd, certs_dir, NODE_0) as node:
            changes = watch_nodes(router)
            registration = NodeRegistration(node, node_info("node-0"), ttl=2)
            await registration.start()
            assert registration.lease_id is not None  # granted and written under auth
            assert (await asyncio.wait_for(anext(changes), 10)).info == node_info("node-0")
            await registration.set_state(NodeState.READY)
            assert (await asyncio.wait_for(anext(changes), 10)).info.state == NodeState.READY
            assert (await node.refresh_lease(registration.lease_id)).TTL > 0  # the keep-alive's call
            await registration.close()  # revokes its lease
            assert await asyncio.wait_for(anext(changes), 10) == MembershipChange("node-0", None)
            await changes.aclose()

    asyncio.run(main())


def test_a_node_may_write_only_its_own_key(etcd, certs_dir):
    async def main() -> None:
        async with client_as(etcd, certs_dir, NODE_0) as node, client_as(etcd, certs_dir, ROUTER_ID) as router:
            for client, key in [(node, b"/kvfleet/nodes/node-1"), (node, b"/kvfleet/block_service/leader"),
                                (node, b"/kvfleet/nodes/node-0x"), (router, b"/kvfleet/nodes/node-0"),
                                (node, b"/kvfleet/block_service/unreachable/node-1")]:
                with pytest.raises(aetcd.ClientError, match="permission denied"):
                    await client.put(key, node_info("node-1").to_json())
            lease = await node.lease(5)
            with pytest.raises(aetcd.ClientError, match="permission denied"):
                await node.put(b"/kvfleet/nodes/node-1", b"{}", lease=lease.id)
            await node.put(b"/kvfleet/block_service/unreachable/node-0", b"127.0.0.1:50051", lease=lease.id)
            await node.revoke_lease(lease.id)  # its complaint goes with its lease
            assert (await router.get_prefix(b"/kvfleet/nodes/")).count == 0
            assert (await router.get_prefix(b"/kvfleet/block_service/unreachable/")).count == 0

    asyncio.run(main())


def test_block_service_leads_and_publishes_its_mark(etcd, certs_dir):
    async def main() -> None:
        async with client_as(etcd, certs_dir, BLOCK_SERVICE_ID) as block, \
                client_as(etcd, certs_dir, ROUTER_ID) as router:
            election = Election(block, Leader("127.0.0.1:50051", "L"), ttl_s=2)
            assert await election.campaign() and election.holds()
            leading = asyncio.create_task(election.lead())  # refreshes its lease and watches its key
            await block.put(DURABLE_KEY.encode(), b'{"lineage": "L", "lsn": 3}')
            assert (await read_leader(router))[0] == Leader("127.0.0.1:50051", "L")
            assert await read_mark(router) == b'{"lineage": "L", "lsn": 3}'
            await election.resign()
            assert await asyncio.wait_for(leading, 10) == "resigned"
            assert (await read_leader(router))[0] is None

    asyncio.run(main())


def test_clients_without_a_certificate_of_the_cluster_ca_are_refused(etcd, certs_dir, tmp_path):
    certs.ensure(tmp_path, [ADMIN_ID])
    foreign = creds(tmp_path, ADMIN_ID)
    trusting = dataclasses.replace(foreign, ca=creds(certs_dir, ADMIN_ID).ca)  # trusts etcd; etcd refuses it

    async def refused(client: aetcd.Client, error: type[Exception], match: str) -> None:
        async with client:
            with pytest.raises(error, match=match):
                await client.get(b"/kvfleet/nodes/node-0")

    async def without_certificate() -> grpc.StatusCode:
        options = [("grpc.ssl_target_name_override", ETCD_ID.host_name)]
        address = etcd.url.removeprefix("https://")
        credentials = grpc.ssl_channel_credentials(creds(certs_dir, ADMIN_ID).ca)
        async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await rpc.KVStub(channel).Range(rpc.RangeRequest(key=b"/kvfleet/"), timeout=5)
        return err.value.code()

    async def main() -> None:
        await refused(etcd_client(etcd.url, timeout=5, credentials=trusting), aetcd.ConnectionFailedError,
                      "handshake failed.*BAD_CERTIFICATE")
        await refused(etcd_client(etcd.url, timeout=5, credentials=foreign), aetcd.ConnectionFailedError,
                      "handshake failed.*CERTIFICATE_VERIFY_FAILED")  # nor does it trust etcd
        await refused(etcd_client(etcd.url.replace("https://", "http://"), timeout=5),
                      aetcd.ConnectionFailedError, "failed to connect")
        await refused(client_as(etcd, certs_dir, ETCD_ID), aetcd.ClientError, "permission denied")  # no user
        assert await without_certificate() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(main())


def test_setting_up_again_adds_a_node_and_corrects_a_role(etcd, certs_dir):
    async def main() -> None:
        async with client_as(etcd, certs_dir, ADMIN_ID) as admin:
            extra = rpc.Permission(permType=READWRITE, key=b"/kvfleet/nodes/", range_end=b"/kvfleet/nodes0")
            await admin.auth_stub.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(name="router", perm=extra))
            applied = await apply(admin.auth_stub, ["node-0", "node-1", "node-2"])
            assert (applied.users_added, applied.roles_changed, applied.enabled_now) == (
                ["node:node-2"], ["node:node-2", "router"], False)
            again = await apply(admin.auth_stub, ["node-2"])
            assert (again.users_added, again.roles_changed, again.enabled_now) == ([], [], False)
        async with client_as(etcd, certs_dir, NODE_2) as node, client_as(etcd, certs_dir, ROUTER_ID) as router:
            await node.put(b"/kvfleet/nodes/node-2", b"{}")
            with pytest.raises(aetcd.ClientError, match="permission denied"):
                await router.delete(b"/kvfleet/nodes/node-2")  # its stray readwrite was revoked
            await node.delete(b"/kvfleet/nodes/node-2")

    asyncio.run(main())


def test_the_command(etcd, certs_dir, capsys):
    admin = str(certs.identity_dir(certs_dir, ADMIN_ID))
    assert cli.main(["etcd-auth", "--etcd", etcd.url, "--certs", admin, "--nodes", "node-0,node-1"]) == 0
    assert "already as wanted" in capsys.readouterr().out
    router = str(certs.identity_dir(certs_dir, ROUTER_ID))
    failures = [["--certs", router],                                        # not admin's certificate
                ["--certs", admin, "--nodes", "node 3"],                    # not a node id
                ["--certs", admin, "--etcd", etcd.url.replace("https", "http")]]
    for extra in failures:
        assert cli.main(["etcd-auth", "--etcd", etcd.url, "--nodes", "node-0", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvfleet etcd-auth: ") and err.count("\n") == 1, err
