"""Membership against a real etcd process."""

import asyncio
import time

import pytest

from kvfleet.core.kv_rates import KvRates
from kvfleet.core.membership import (
    MembershipChange,
    NodeInfo,
    NodeRegistration,
    NodeState,
    etcd_client,
    list_nodes,
    node_key,
    watch_nodes,
)


def info(node_id="n1", state=NodeState.WARMING):
    return NodeInfo(node_id, "127.0.0.1:7001", "/models/tiny", 64, 256, state)


def test_node_info_round_trips_and_keys_are_checked():
    i = info(state=NodeState.READY)
    assert NodeInfo.from_json("n1", i.to_json()) == i
    assert node_key("n1") == b"/kvfleet/nodes/n1"
    for bad in ["", "a/b"]:
        with pytest.raises(ValueError):
            node_key(bad)
    with pytest.raises(ValueError, match="etcd URL"):
        etcd_client("grpc://x:1")


async def _next(changes, timeout=10.0) -> MembershipChange:
    return await asyncio.wait_for(anext(changes), timeout)


def test_register_update_watch_and_revoke(etcd):
    prefix = "/kvfleet/test-a/"

    async def main():
        async with etcd_client(etcd.url) as client:
            changes = watch_nodes(client, prefix)
            reg = NodeRegistration(client, info(), ttl=3, prefix=prefix)
            await reg.start()
            first = await _next(changes)
            assert first.info == info()
            await reg.set_state(NodeState.READY)
            assert (await _next(changes)).info.state == NodeState.READY
            nodes, _ = await list_nodes(client, prefix)
            assert nodes == {"n1": info(state=NodeState.READY)}
            # The keep-alive holds the key well past its TTL.
            await asyncio.sleep(4.5)
            assert (await list_nodes(client, prefix))[0]
            await reg.close()
            assert await _next(changes) == MembershipChange("n1", None)
            await changes.aclose()

    asyncio.run(main())


def test_a_node_publishes_its_measured_rates_and_watchers_read_them(etcd):
    """``update(kv_rates=...)`` rewrites the record; a watcher (the router) reads the rates back,
    and a record written without them reads as no rates."""
    prefix = "/kvfleet/test-rates/"
    rates = KvRates(prefill_tokens_per_s=9000.0, copy_in_bytes_per_s=2.4e10, fetch_bytes_per_s=1.1e9,
                    bytes_per_token=131072.0)

    async def main():
        async with etcd_client(etcd.url) as client:
            changes = watch_nodes(client, prefix)
            reg = NodeRegistration(client, info("n3"), ttl=3, prefix=prefix)
            await reg.start()
            assert (await _next(changes)).info.kv_rates is None
            await reg.update(kv_rates=rates)
            published = NodeInfo("n3", "127.0.0.1:7001", "/models/tiny", 64, 256, NodeState.WARMING, kv_rates=rates)
            assert reg.info == published
            assert (await _next(changes)).info == published
            assert (await list_nodes(client, prefix))[0] == {"n3": published}
            await reg.close()
            await changes.aclose()

    asyncio.run(main())


def test_a_silent_node_leaves_within_its_ttl(etcd):
    prefix = "/kvfleet/test-b/"

    async def main():
        async with etcd_client(etcd.url) as client:
            reg = NodeRegistration(client, info("n2"), ttl=2, prefix=prefix)
            await reg.start()
            changes = watch_nodes(client, prefix)
            assert (await _next(changes)).node_id == "n2"
            await reg.close(revoke=False)  # as if the process had been killed
            t0 = time.monotonic()
            assert await _next(changes, timeout=8) == MembershipChange("n2", None)
            # etcd checks expiry at a coarse tick: allow one extra second over the TTL.
            assert time.monotonic() - t0 <= 2 + 1.5
            await changes.aclose()

    asyncio.run(main())


@pytest.mark.process
def test_a_node_registers_once_etcd_comes_up(tmp_path):
    """A node started while etcd is down neither raises nor exits: its registration (and a state
    change made meanwhile) reaches etcd once etcd answers."""
    from kvfleet.cli.etcd_server import EtcdServer

    etcd = EtcdServer(data_dir=tmp_path / "etcd").start()
    prefix = "/kvfleet/test-late/"

    async def scenario():
        etcd.process.kill()
        etcd.process.wait()
        async with etcd_client(etcd.url, timeout=1.0) as client:
            registration = NodeRegistration(client, info("late"), ttl=2, prefix=prefix)
            await registration.start()
            await registration.set_state(NodeState.READY)
            etcd.restart()
            deadline = time.monotonic() + 30
            nodes = {}
            while time.monotonic() < deadline and "late" not in nodes:
                await asyncio.sleep(0.2)
                try:
                    nodes, _ = await list_nodes(client, prefix)
                except Exception:  # etcd still starting
                    continue
            await registration.close()
        return nodes

    try:
        nodes = asyncio.run(scenario())
    finally:
        etcd.stop()
    assert nodes["late"].state == NodeState.READY
