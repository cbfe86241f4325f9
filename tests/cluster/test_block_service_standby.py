"""block_service with a standby (issue 19): the leader SIGKILLed under load, the standby takes over
through etcd, the nodes and the router find it there and every stream finishes token-exact. Real
etcd, two block_service replicas, nodes and router (LocalCluster), a shortened lease."""

from __future__ import annotations

import threading

import grpc
from cluster_helpers import request
from test_node_survival import MAX_TOKENS, NUM_STREAMS, expected, generate, no_live_sequences, pids, until  # noqa: F401

from kvfleet.v1 import inference_pb2_grpc

LEASE_TTL = 2


def test_the_standby_takes_over_when_the_leader_is_killed_under_load(start_cluster, expected):  # noqa: F811
    prompts, want = expected
    cluster = start_cluster(2, block_service_standby=True, lease_ttl_s=LEASE_TTL,
                            compute_args=("--reconcile-interval", "5"))
    leader = until("a block_service leader", cluster.block_service_leader)
    assert leader == f"127.0.0.1:{cluster.block_service.port}"
    before = pids(cluster)
    results: list = [None] * NUM_STREAMS
    started = threading.Barrier(NUM_STREAMS + 1)

    def one(i: int) -> None:
        got: list[int] = []
        try:
            with grpc.insecure_channel(cluster.router_address) as channel:
                call = inference_pb2_grpc.InferenceStub(channel).Generate(
                    request(tokens=prompts[i], max_tokens=MAX_TOKENS, ignore_eos=True),
                    metadata=[("authorization", "Bearer sk-gold")], timeout=300)
                for n, chunk in enumerate(call):
                    got.extend(chunk.token_ids)
                    if n == 2:
                        started.wait(60)
            results[i] = got
        except Exception as e:  # reported below, with the others
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_STREAMS)]
    for t in threads:
        t.start()
    started.wait(120)                        # every stream is decoding
    cluster.kill("block_service")            # SIGKILL the leader: its lease lapses, no restart
    standby = f"127.0.0.1:{cluster.block_service_standby.port}"
    until("the standby leads", lambda: cluster.block_service_leader() == standby)
    for t in threads:
        t.join(300)
    assert results == want                   # every stream finished, token-exact
    assert pids(cluster) == before and all(c.alive() for c in cluster.nodes.values())
    assert generate(cluster, prompts[0]) == want[0]  # a new request, its blocks from the new leader
    until("the new leader holds nothing for the idle nodes", lambda: no_live_sequences(cluster))
    for node in cluster.nodes.values():
        assert "block_service leader is " + standby in node.log_path.read_text()
