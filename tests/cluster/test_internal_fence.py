"""Behind the public door: the attacks of issue 27, tried against a cluster of separate processes
started the documented way (mutual TLS by default), from this test process as an outsider with no
certificate, with a certificate of another CA, and as the wrong identity of the cluster's own CA.
Every one of them succeeded before; each is refused now, and the cluster serves on, untouched."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from cluster_helpers import random_prompt, request, stream, tokens_of

from kvfleet.core import certs, rpc, tls
from kvfleet.core.identity import ADMIN_ID, BLOCK_SERVICE_ID, ROUTER_ID, Identity
from kvfleet.core.tenants import Tenant
from kvfleet.v1 import block_manager_pb2 as bm
from kvfleet.v1 import block_manager_pb2_grpc as bm_grpc
from kvfleet.v1 import compute_pb2 as cp
from kvfleet.v1 import compute_pb2_grpc as cp_grpc
from kvfleet.v1 import inference_pb2 as ip

NODE0, NODE1 = Identity.node("node-0"), Identity.node("node-1")


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    return shared_cluster()


def _creds(cluster, identity: Identity) -> tls.Credentials:
    return tls.Credentials.load(certs.identity_dir(cluster.certs.root, identity), identity)


async def _serve_once(stub: cp_grpc.ComputeStub):
    """``Compute.Serve`` of one request for tenant alpha, as the attack sent it: the events, read."""
    start = cp.ComputeRequest(request_id="attack", tenant="gold", prompt_token_ids=random_prompt(20, 1),
                              sampling=ip.SamplingParams(max_tokens=8))
    commands = iter([cp.NodeCommands(commands=[cp.NodeCommand(start=start)])])
    return [e async for e in stub.Serve(commands, timeout=10)]


def _attacks(block_channel: grpc.aio.Channel, node_channel: grpc.aio.Channel):
    """The four calls of the issue, each a coroutine to await."""
    block = bm_grpc.BlockManagerStub(block_channel)
    raised = bm.ConfigureTenantsRequest(tenants=[bm.TenantQuota(name="small", quota_mib=100 * 1024, paid_level=9,
                                                                max_concurrent=1000)])
    return {
        "Stats": lambda: block.Stats(bm.BlockStatsRequest(), timeout=10),
        "ConfigureTenants": lambda: block.ConfigureTenants(raised, timeout=10),
        "DeregisterNode": lambda: block.DeregisterNode(bm.DeregisterNodeRequest(node_id="node-0"), timeout=10),
        "Serve": lambda: _serve_once(cp_grpc.ComputeStub(node_channel)),
    }


def _codes(block_channel, node_channel) -> dict[str, grpc.StatusCode]:
    """Each attack's status code; the channels are made (``block_channel()``) on the loop."""
    return asyncio.run(_attack(block_channel, node_channel))


async def _attack(make_block_channel, make_node_channel) -> dict[str, grpc.StatusCode]:
    block_channel, node_channel = make_block_channel(), make_node_channel()
    codes = {}
    for name, attack in _attacks(block_channel, node_channel).items():
        try:
            await attack()
            codes[name] = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as err:
            codes[name] = err.code()
    await block_channel.close()
    await node_channel.close()
    return codes


def test_an_outsider_without_a_certificate_of_the_cluster_gets_nothing(cluster, tmp_path):
    block, node = cluster.block_service_address, cluster.nodes["node-0"]
    node_address = f"127.0.0.1:{node.port}"
    plaintext = _codes(lambda: grpc.aio.insecure_channel(block), lambda: grpc.aio.insecure_channel(node_address))
    assert plaintext == dict.fromkeys(plaintext, grpc.StatusCode.UNAVAILABLE), plaintext

    certs.ensure(tmp_path, [ADMIN_ID, ROUTER_ID])  # the right names, from another CA
    for identity in (ADMIN_ID, ROUTER_ID):
        foreign = _creds_at(tmp_path, identity)
        codes = _codes(lambda: rpc.channel(block, peer=BLOCK_SERVICE_ID, credentials=foreign),
                       lambda: rpc.channel(node_address, peer=NODE0, credentials=foreign))
        assert codes == dict.fromkeys(codes, grpc.StatusCode.UNAVAILABLE), (identity, codes)


def _creds_at(root, identity):
    return tls.Credentials.load(certs.identity_dir(root, identity), identity)


def test_the_cluster_s_own_identities_get_only_their_own_calls(cluster):
    block, node_address = cluster.block_service_address, f"127.0.0.1:{cluster.nodes['node-0'].port}"
    # a node's certificate: no tenant changes, no other node's removal, no requests on a node
    as_node = _creds(cluster, NODE1)
    codes = _codes(lambda: rpc.channel(block, peer=BLOCK_SERVICE_ID, credentials=as_node),
                   lambda: rpc.channel(node_address, peer=NODE0, credentials=as_node))
    assert codes == dict.fromkeys(codes, grpc.StatusCode.PERMISSION_DENIED), codes
    # the router's: fleet reads and a node's removal are its own; tenant changes are admin's
    as_router = _creds(cluster, ROUTER_ID)
    codes = _codes(lambda: rpc.channel(block, peer=BLOCK_SERVICE_ID, credentials=as_router),
                   lambda: rpc.channel(node_address, peer=NODE0, credentials=as_router))
    assert codes["ConfigureTenants"] == grpc.StatusCode.PERMISSION_DENIED and codes["Stats"] == grpc.StatusCode.OK

    log = cluster.block_service.log_path.read_text()
    assert "PERMISSION_DENIED node:node-1 calling /kvfleet.v1.BlockManager/ConfigureTenants from" in log
    assert "PERMISSION_DENIED router calling /kvfleet.v1.BlockManager/ConfigureTenants from" in log
    assert "PERMISSION_DENIED node:node-1 calling /kvfleet.v1.Compute/Serve" in cluster.nodes["node-0"].log_path.read_text()


def test_a_node_certificate_does_not_pass_for_another_node(cluster):
    """The router dials node-1 expecting node-1's certificate: a process holding node-0's
    certificate at node-1's address (an address in etcd is all an attacker could change) is
    refused at the handshake. Here: the real node-0 answers where "node-1" is expected."""
    node0 = f"127.0.0.1:{cluster.nodes['node-0'].port}"
    as_router = _creds(cluster, ROUTER_ID)

    async def stats_of(peer: Identity) -> grpc.StatusCode:
        async with rpc.channel(node0, peer=peer, credentials=as_router) as channel:
            try:
                await cp_grpc.ComputeStub(channel).Stats(cp.ComputeStatsRequest(), timeout=10)
                return grpc.StatusCode.OK
            except grpc.aio.AioRpcError as err:
                return err.code()

    assert asyncio.run(stats_of(NODE0)) == grpc.StatusCode.OK
    assert asyncio.run(stats_of(NODE1)) == grpc.StatusCode.UNAVAILABLE


def test_admin_may_change_tenants_and_the_cluster_serves_on_untouched(cluster):
    from kvfleet.block_service.client import BlockManagerClient

    async def as_admin():
        async with BlockManagerClient(cluster.block_service_address, timeout_s=10,
                                      credentials=_creds(cluster, ADMIN_ID)) as admin:
            await admin.configure_tenants([Tenant("probe", quota_mib=1.0)])  # a tenant nobody uses
            nodes, tenants = await admin.stats()
        return {n.node_id for n in nodes}, {t.tenant for t in tenants}

    nodes, tenants = asyncio.run(as_admin())
    assert nodes == {"node-0", "node-1"}  # nobody deregistered node-0
    assert "probe" in tenants and "small" not in tenants  # admin's change is in, the attacks' never was
    chunks = stream(cluster.router_address, request(tokens=random_prompt(30, 7), max_tokens=6))
    assert len(tokens_of(chunks)) == 6
    for child in cluster.children():
        log = child.log_path.read_text()
        assert "Traceback" not in log, (child.name, log[-2000:])


def test_etcd_takes_a_node_s_word_only_for_its_own_key(cluster):
    """Nobody registers a fake node for the router to send traffic to: a node's certificate
    writes only its own membership key, and without a certificate etcd does not answer."""
    import aetcd

    from kvfleet.core.membership import etcd_client, list_nodes

    async def attempts():
        async with etcd_client(cluster.etcd.url, credentials=_creds(cluster, NODE1)) as node1:
            with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
                await node1.put(b"/kvfleet/nodes/fake", b'{"address": "127.0.0.1:1"}')
            with pytest.raises(aetcd.exceptions.ClientError, match="permission denied"):
                await node1.delete(b"/kvfleet/nodes/node-0")
            nodes, _ = await list_nodes(node1)  # reading the membership is every identity's
        assert set(nodes) == {"node-0", "node-1"}
        plain = cluster.etcd.url.replace("https://", "http://")
        with pytest.raises(aetcd.exceptions.ConnectionFailedError):
            async with etcd_client(plain, timeout=3) as outsider:
                await outsider.put(b"/kvfleet/nodes/fake", b"{}")

    asyncio.run(attempts())
