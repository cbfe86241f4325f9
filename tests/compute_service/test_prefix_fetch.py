"""Admission's peer fetch, its logic alone: which peer, when, shared fetches, what is counted. The
block_service lookup and the fetch itself are doubles here; the real ones run in
test_kv_fetch.py (in process) and tests/cluster/test_cluster_kv_fetch.py (separate processes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvfleet.compute_service.engine.prefill_rate import PrefillRate
from kvfleet.compute_service.node.fetch_policy import FetchCost, KvFetchSettings
from kvfleet.compute_service.node.kv_fetch import Fetched
from kvfleet.compute_service.node.peer_directory import PeerDirectory
from kvfleet.compute_service.node.prefix_fetch import PrefixFetcher
from kvfleet.core.membership import NodeInfo, NodeState

BS = 16
PROMPT = list(range(10 * BS + 3))  # 10 full blocks


def directory(**states: NodeState) -> PeerDirectory:
    peers = PeerDirectory("me")
    for node_id, state in states.items():
        peers.apply(node_id, NodeInfo(node_id, f"10.0.0.{len(peers.peers) + 1}:7000", "m", 64, BS, state))
    return peers


class Doubles:
    def __init__(self, held: dict[str, int], peers: PeerDirectory, mode: str = "always", result=None, gate=None):
        self.held, self.calls, self.result, self.gate = held, [], result, gate
        engine = SimpleNamespace(engine=SimpleNamespace(prefill_rate=PrefillRate()))
        self.fetcher = PrefixFetcher("me", engine, self.match, peers,
                                     FetchCost(KvFetchSettings(kv_fetch=mode), BS, 1000), b"seed", fetch=self.fetch)

    async def match(self, hashes):
        return ({n: min(k, len(hashes)) for n, k in self.held.items()}, {})

    async def fetch(self, address, node_id, tenant, hashes, engine, deadline_s, prefix_group="", peers=None):
        self.calls.append((address, node_id, tenant, len(hashes)))
        if self.gate is not None:
            await self.gate.wait()
        return self.result or Fetched(0, len(hashes), len(hashes) * 1000)


def test_the_serving_peer_holding_most_is_fetched_from():
    peers = directory(a=NodeState.READY, b=NodeState.WARMING, c=NodeState.DRAINING)
    d = Doubles({"me": 2, "a": 5, "b": 10, "c": 8}, peers)
    asyncio.run(d.fetcher.before_admission("t", PROMPT))
    assert d.calls == [("10.0.0.3:7000", "c", "t", 8)]  # b holds more but is not serving; c drains, still serves
    f = d.fetcher.figures
    assert (f.blocks, f.bytes, dict(f.decisions), dict(f.fallbacks)) == (8, 8000, {"fetch": 1}, {})
    assert f.seconds.snapshot().count == 1


def test_nothing_is_fetched_when_this_node_holds_as_much_or_no_peer_serves():
    d = Doubles({"me": 10, "a": 10}, directory(a=NodeState.READY))
    asyncio.run(d.fetcher.before_admission("t", PROMPT))
    unlisted = Doubles({"me": 1, "gone": 10}, directory(a=NodeState.READY))
    asyncio.run(unlisted.fetcher.before_admission("t", PROMPT))
    assert d.calls == unlisted.calls == []
    assert dict(unlisted.fetcher.figures.fallbacks) == {"no_peer": 1}
    off = Doubles({"a": 10}, directory(a=NodeState.READY), mode="off")
    asyncio.run(off.fetcher.before_admission("t", PROMPT))
    assert off.calls == []


def test_requests_after_the_same_run_share_one_fetch():
    async def main():
        gate = asyncio.Event()
        d = Doubles({"a": 10}, directory(a=NodeState.READY), gate=gate)
        waiting = [asyncio.create_task(d.fetcher.before_admission("t", PROMPT)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert d.fetcher.figures.in_flight == 1
        gate.set()
        await asyncio.gather(*waiting)
        other_tenant = asyncio.create_task(d.fetcher.before_admission("u", PROMPT))  # another chain: its own fetch
        await other_tenant
        return d

    d = asyncio.run(main())
    assert [c[2] for c in d.calls] == ["t", "u"]
    assert d.fetcher.figures.in_flight == 0 and d.fetcher.figures.decisions["fetch"] == 4


def test_a_fetch_that_stops_short_is_counted_by_its_reason_and_the_rate_learns_only_from_bytes():
    d = Doubles({"a": 10}, directory(a=NodeState.READY), result=Fetched(0, 3, 3000, "deadline"))
    asyncio.run(d.fetcher.before_admission("t", PROMPT))
    nothing = Doubles({"a": 10}, directory(a=NodeState.READY), result=Fetched(0, 0, 0, "peer"))
    asyncio.run(nothing.fetcher.before_admission("t", PROMPT))
    assert dict(d.fetcher.figures.fallbacks) == {"deadline": 1} and d.fetcher.figures.blocks == 3
    assert d.fetcher.cost.fetch_rate.observations == 1
    assert dict(nothing.fetcher.figures.fallbacks) == {"peer": 1}
    assert nothing.fetcher.cost.fetch_rate.observations == 0


def test_a_lookup_that_fails_means_a_prefill():
    d = Doubles({}, directory(a=NodeState.READY))

    async def down(_hashes):
        raise ConnectionError("block_service is away")

    d.fetcher.match = down
    asyncio.run(d.fetcher.before_admission("t", PROMPT))
    assert d.calls == [] and dict(d.fetcher.figures.fallbacks) == {"lookup": 1}
