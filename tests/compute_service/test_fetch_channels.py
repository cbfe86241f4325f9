"""The channel a node keeps to each peer for its KV fetches (``PeerDirectory.channel``): the same one
from fetch to fetch (no connection, TLS handshake or flow-control window grown again per fetch),
dialled afresh after a fetch failed at the peer, closed when the peer leaves or moves and when
this process's credentials change."""

from __future__ import annotations

import asyncio

import grpc

from kvfleet.compute_service.node.kv_fetch import fetch_blocks
from kvfleet.compute_service.node.peer_directory import PeerDirectory
from kvfleet.core import certs, tls
from kvfleet.core.identity import Identity
from kvfleet.core.membership import NodeInfo, NodeState
from tests.compute_service.kv_peers import BS, HOLDER, PROMPT, counts, hashes_of, make_engine, peers, serve

HASHES = hashes_of(PROMPT, "default", 4)


def listed(directory: PeerDirectory, node_id: str, address: str, state: NodeState = NodeState.READY) -> None:
    directory.apply(node_id, NodeInfo(node_id, address, "m", 64, BS, state))


def test_a_peers_channel_is_kept_between_fetches_and_dialled_afresh_after_a_failure(llama_dir):
    holder, receiver = make_engine(llama_dir, 64), make_engine(llama_dir, 64)
    serve(holder, PROMPT)

    async def main():
        directory = PeerDirectory("n1")
        async with peers(holder, receiver) as (address, engine):
            listed(directory, HOLDER, address)
            kept = directory.channel(HOLDER)
            assert (await fetch_blocks(address, HOLDER, "default", HASHES[:2], engine, 30, peers=directory)).blocks == 2
            assert (await fetch_blocks(address, HOLDER, "default", HASHES, engine, 30, peers=directory)).blocks == 4
            assert directory.channel(HOLDER) is kept
            assert kept.get_state() == grpc.ChannelConnectivity.READY  # it carried both

            listed(directory, "gone", "127.0.0.1:1")
            unreachable = directory.channel("gone")
            got = await fetch_blocks("127.0.0.1:1", "gone", "default", hashes_of(PROMPT, "other", 4), engine, 30,
                                     peers=directory)
            assert (got.blocks, got.reason) == (0, "peer")
            assert directory.channel("gone") is not unreachable  # no waiting out the old one's reconnect backoff
            await directory.close()
            assert kept.get_state() == grpc.ChannelConnectivity.SHUTDOWN
            return await engine.call(counts)

    assert asyncio.run(main()) == (60, 4, 0)


def test_a_kept_channel_is_closed_when_its_peer_leaves_or_moves_or_the_credentials_change(tmp_path):
    me = Identity.node("me")
    certs.ensure(tmp_path, [me])

    def renewed_credentials() -> None:
        tls.use(tls.Credentials.load(certs.identity_dir(tmp_path, me), me))

    async def main():
        directory = PeerDirectory("me")
        listed(directory, "a", "127.0.0.1:7001")
        first = directory.channel("a")
        listed(directory, "a", "127.0.0.1:7001", NodeState.DRAINING)  # still serving its blocks: kept
        assert directory.channel("a") is first
        listed(directory, "a", "127.0.0.1:7002")
        moved = directory.channel("a")
        assert moved is not first
        renewed_credentials()  # a channel under the renewed ones
        renewed = directory.channel("a")
        assert renewed is not moved
        assert directory.channel("a") is renewed
        listed(directory, "a", "127.0.0.1:7002", NodeState.WARMING)
        assert directory.channel("a") is None
        directory.apply("a", None)
        await asyncio.sleep(0.1)  # the closes run as tasks
        return [c.get_state() for c in (first, moved, renewed)]

    try:
        assert asyncio.run(main()) == [grpc.ChannelConnectivity.SHUTDOWN] * 3
    finally:
        tls.use(None)
