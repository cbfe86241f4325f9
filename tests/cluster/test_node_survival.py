"""A compute node never dies of a peer's trouble: block_service SIGKILLed under load and
restarted, etcd down for longer than the lease TTL, a leaked sequence in block_service, a node
started while block_service is down. Real etcd, block_service, nodes and router (LocalCluster).
"""

from __future__ import annotations

import signal
import time

import cluster_helpers
import grpc
import pytest
from cluster_helpers import BLOCK_SIZE, random_prompt, request, tokens_of

from kvfleet.block_service.durable import recover
from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core import certs, rpc, tls
from kvfleet.core.identity import Identity
from kvfleet.core.sampling import SamplingParams
from kvfleet.v1 import compute_pb2, compute_pb2_grpc

pytestmark = pytest.mark.chaos  # each test kills or stops a part of the cluster on purpose

LEASE_TTL = 2
NUM_STREAMS = 6
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def expected(model_dir):
    """Greedy tokens of the test prompts from an in-process engine (the same model)."""
    prompts = [random_prompt(20 + 7 * i, seed=40 + i) for i in range(NUM_STREAMS)]
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return prompts, [o.new_token_ids for o in outs]


def generate(cluster, prompt: list[int]) -> list[int]:
    """The tokens the cluster streams for ``prompt`` (greedy, ``MAX_TOKENS``)."""
    req = request(tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    return tokens_of(cluster_helpers.stream(cluster.router_address, req))


def pids(cluster) -> dict[str, int]:
    return {n: c.process.pid for n, c in cluster.nodes.items()}


def until(what: str, check, timeout: float = 60.0):
    """Poll ``check()`` until it is truthy (a deadline for a broken cluster, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.2)
    return result


def no_live_sequences(cluster) -> bool:
    try:
        pools = cluster_helpers.block_pools(cluster)
    except Exception:  # block_service still replaying its log
        return False
    return set(pools) == set(cluster.nodes) and all(p.num_sequences == 0 and p.num_used == 0
                                                    for p in pools.values())


def check_state(cluster) -> None:
    """block_service's durable state recovers, holds its invariants, and agrees with what it serves."""
    table, _ = recover(str(cluster.work_dir / "block_state"))
    table.check()
    for node_id in cluster.nodes:
        assert table.node_stats(node_id).num_sequences == 0


def test_block_service_killed_under_load_and_restarted(start_cluster, expected):
    prompts, want = expected
    cluster = start_cluster(2, compute_args=("--reconcile-interval", "5"))
    before = pids(cluster)
    streams = cluster_helpers.Streams(cluster.router_address, prompts, MAX_TOKENS)
    streams.wait_decoding()                # every stream is decoding
    cluster.kill("block_service")          # SIGKILL: no goodbye, state as last written
    time.sleep(1.0)                        # the nodes notice while requests are in flight
    cluster.restart("block_service")       # same port, same state directory
    results = streams.join()
    assert results == want                 # every stream finished, token-exact
    assert pids(cluster) == before and all(c.alive() for c in cluster.nodes.values())
    assert cluster.node_states() == {n: "READY" for n in cluster.nodes}
    assert [generate(cluster, p) for p in prompts[:2]] == want[:2]
    until("block_service holds nothing for the idle nodes", lambda: no_live_sequences(cluster))
    check_state(cluster)


def test_etcd_down_longer_than_the_lease_then_back(start_cluster, expected):
    prompts, want = expected
    cluster = start_cluster(1, compute_args=("--lease-ttl", str(LEASE_TTL), "--reconcile-interval", "1"))
    before = pids(cluster)
    etcd = cluster.etcd.process
    etcd.send_signal(signal.SIGKILL)
    etcd.wait()
    time.sleep(4 * LEASE_TTL)              # the lease runs out while etcd is away
    cluster.restart("etcd")
    # The lease runs out once etcd is back and the node's keep-alive has not reached it within the
    # TTL. Whether the node's client reconnects that fast is up to gRPC's reconnect backoff, so
    # the expiry is made certain: the lease goes as an expiry would take it (key deleted).
    until("etcd back with node-0's key", lambda: _revoke_lease(cluster, "node-0"))
    _drop_pool(cluster, "node-0")  # what a router does when it sees the key go (if it has not yet)
    until("node-0 registered again", lambda: "registered again in etcd" in cluster.nodes["node-0"].log_path.read_text())
    until("node-0 READY in etcd again", lambda: _state(cluster, "node-0") == "READY")
    until("node-0's pool in block_service", lambda: "node-0" in cluster_helpers.block_pools(cluster))
    assert until("the router serves again", lambda: _try_generate(cluster, prompts[0])) == want[0]
    assert pids(cluster) == before and cluster.nodes["node-0"].alive()
    until("block_service holds nothing for the idle node", lambda: no_live_sequences(cluster))
    assert "node-0" in cluster_helpers.block_pools(cluster)


def _revoke_lease(cluster, node_id: str) -> bool:
    import asyncio

    from kvfleet.core.membership import etcd_client, node_key

    async def revoke() -> bool:
        async with etcd_client(cluster.etcd.url) as client:
            kv = await client.get(node_key(node_id))
            if kv is None:
                return False
            await client.revoke_lease(kv.lease)
            return True

    try:
        return asyncio.run(revoke())
    except Exception:  # etcd still starting
        return False


def _drop_pool(cluster, node_id: str) -> None:
    import asyncio

    from kvfleet.block_service.client import BlockManagerClient
    from kvfleet.core.errors import NotFound

    async def drop() -> None:
        async with BlockManagerClient(cluster.block_service_address) as client:
            try:
                await client.deregister_node(node_id)
            except NotFound:
                pass

    asyncio.run(drop())


def _state(cluster, node_id: str) -> str | None:
    try:
        return cluster.node_states().get(node_id)
    except Exception:  # etcd still starting
        return None


def _try_generate(cluster, prompt):
    try:
        return generate(cluster, prompt)
    except grpc.RpcError:  # the router has not seen the node come back yet
        return None


def test_a_leaked_sequence_is_released_by_the_periodic_reconciliation(start_cluster):
    import asyncio

    from kvfleet.block_service.client import BlockManagerClient

    cluster = start_cluster(1, compute_args=("--reconcile-interval", "1"))

    node0 = Identity.node("node-0")
    as_node0 = tls.Credentials.load(certs.identity_dir(cluster.certs.root, node0), node0)

    async def leak_and_watch():
        async with BlockManagerClient(cluster.block_service_address, credentials=as_node0) as node, \
                BlockManagerClient(cluster.block_service_address) as client:  # admin, as this process
            await node.allocate("node-0", "leaked-by-a-lost-release", "gold", [], 3 * BLOCK_SIZE)
            assert [s.seq_id for s in await client.sequences(["leaked-by-a-lost-release"])]
            deadline = time.monotonic() + 60
            while (await client.stats(["node-0"]))[0][0].num_sequences:
                assert time.monotonic() < deadline, "the leaked sequence was never released"
                await asyncio.sleep(0.2)

    asyncio.run(leak_and_watch())
    assert cluster.nodes["node-0"].alive()
    assert "reconciliation with block_service released 1" in cluster.nodes["node-0"].log_path.read_text()
    with rpc.sync_channel(f"127.0.0.1:{cluster.nodes['node-0'].port}", peer=Identity.node("node-0")) as channel:
        stats = compute_pb2_grpc.ComputeStub(channel).Stats(compute_pb2.ComputeStatsRequest(), timeout=30)
    assert stats.reconciled_sequences == 1


def test_a_node_started_while_block_service_is_down_waits_for_it(start_cluster, expected):
    prompts, want = expected
    cluster = start_cluster(1)
    cluster.kill("block_service")
    node = cluster.add_node("node-1", wait=False)
    until("node-1 says it waits", lambda: "waiting for block_service" in node.log_path.read_text())
    assert node.alive()
    cluster.restart("block_service")
    cluster.wait_ready(["node-1"])
    assert cluster.nodes["node-0"].alive()
    assert generate(cluster, prompts[1]) == want[1]
