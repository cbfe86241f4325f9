"""Who may fetch which KV blocks from a node, under the cluster's mutual TLS (a real holder server in
this process, over loopback): any node of the cluster, only for the tenant whose chain named the
blocks; the router (or any identity but a node) is refused by the access table."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from kvfleet.compute_service.node.kv_fetch import fetch_blocks
from kvfleet.core import certs, rpc, tls
from kvfleet.core.identity import ROUTER_ID, Identity
from kvfleet.v1 import compute_pb2 as pb
from kvfleet.v1 import compute_pb2_grpc
from tests.compute_service.kv_peers import HOLDER, PROMPT, counts, hashes_of, make_engine, peers, serve

HOLDER_ID, RECEIVER_ID = Identity.node(HOLDER), Identity.node("n1")


@pytest.fixture(scope="module")
def certs_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("certs")
    certs.ensure(root, [HOLDER_ID, RECEIVER_ID, ROUTER_ID])
    return root


def creds(certs_dir, identity: Identity) -> tls.Credentials:
    return tls.Credentials.load(certs.identity_dir(certs_dir, identity), identity)


def under_tls(certs_dir, holder, receiver, body):
    """``await body(address, receiver's AsyncEngine)`` with the holder serving under its own
    certificate and this process then speaking as node n1."""
    async def main():
        tls.use(creds(certs_dir, HOLDER_ID))
        try:
            async with peers(holder, receiver) as (address, engine):
                tls.use(creds(certs_dir, RECEIVER_ID))
                return await body(address, engine)
        finally:
            tls.use(None)
    return asyncio.run(main())


@pytest.fixture
def holder(llama_dir):
    engine = make_engine(llama_dir, 64)
    serve(engine, PROMPT, tenant="a")
    return engine


def test_a_node_fetches_but_the_router_is_refused_by_the_access_table(certs_dir, llama_dir, holder, caplog):
    receiver = make_engine(llama_dir, 64)
    hashes = hashes_of(PROMPT, "a", 4)

    async def body(address, engine):
        async with rpc.channel(address, max_receive_bytes=rpc.MAX_MESSAGE_BYTES, peer=HOLDER_ID,
                               credentials=creds(certs_dir, ROUTER_ID)) as channel:
            call = compute_pb2_grpc.ComputeStub(channel).FetchBlocks(
                pb.FetchBlocksRequest(tenant="a", block_hashes=b"".join(hashes)), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "router may not call /kvfleet.v1.Compute/FetchBlocks (only node:<id>)" in err.value.details()
        return (await fetch_blocks(address, HOLDER, "a", hashes, engine, 10)).blocks

    with caplog.at_level(logging.WARNING, logger="kvfleet.core.access_guard"):
        assert under_tls(certs_dir, holder, receiver, body) == 4
    assert counts(receiver) == (60, 4, 0)
    assert any(r.getMessage().startswith("PERMISSION_DENIED router calling /kvfleet.v1.Compute/FetchBlocks")
               for r in caplog.records)


def test_another_tenants_blocks_are_not_served_and_the_attempt_is_logged(certs_dir, llama_dir, holder, caplog):
    receiver = make_engine(llama_dir, 64)
    theirs = hashes_of(PROMPT, "a", 4)  # tenant a's chain, asked for as tenant b

    async def body(address, engine):
        return (await fetch_blocks(address, HOLDER, "b", theirs, engine, 10)).blocks

    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.kv_holder"):
        assert under_tls(certs_dir, holder, receiver, body) == 0
    assert counts(receiver) == (64, 0, 0)
    [line] = [r.getMessage() for r in caplog.records if r.name == "kvfleet.compute_service.node.kv_holder"]
    assert line.startswith("FetchBlocks by node:n1 for tenant 'b': block 0 of the 4 asked for is held under another "
                           "salt")
    assert "'a'" not in line  # whose the blocks are is not said
    # the tenant's own chain of the same tokens is another chain: the holder does not have it
    assert hashes_of(PROMPT, "b", 4) != theirs


def test_a_hash_list_that_is_not_whole_hashes_is_invalid_argument(certs_dir, llama_dir, holder):
    receiver = make_engine(llama_dir, 64)

    async def body(address, engine):
        async with rpc.channel(address, max_receive_bytes=rpc.MAX_MESSAGE_BYTES, peer=HOLDER_ID) as channel:
            stub = compute_pb2_grpc.ComputeStub(channel)
            codes = []
            for request in (pb.FetchBlocksRequest(tenant="a", block_hashes=b"\x01" * 15),
                            pb.FetchBlocksRequest(tenant="", block_hashes=b"\x01" * 16)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.FetchBlocks(request, timeout=10):
                        pass
                codes.append((err.value.code(), err.value.details()))
            return codes

    codes = under_tls(certs_dir, holder, receiver, body)
    assert codes[0] == (grpc.StatusCode.INVALID_ARGUMENT,
                        "block_hashes has 15 bytes, not a whole number of 16-byte hashes")
    assert codes[1][0] == grpc.StatusCode.INVALID_ARGUMENT and codes[1][1].startswith("tenant is empty")
