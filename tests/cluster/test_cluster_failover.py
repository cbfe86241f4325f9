"""A compute node dies mid-stream: the client still gets every token exactly once."""

from __future__ import annotations

import signal
import time

import grpc
from cluster_helpers import BLOCK_SIZE, block_pools, random_prompt, request, stream

from compute_service.engine import EngineConfig, LLMEngine
from kvfleet.sampling import SamplingParams
from kvfleet.v1 import inference_pb2, inference_pb2_grpc

MAX_TOKENS = 1200
LEASE_TTL = 3


def test_sigkill_mid_stream_resumes_on_another_node(start_cluster, model_dir):
    prompt = random_prompt(40, seed=5)
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
    expected = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].new_token_ids
    del engine

    cluster = start_cluster(2, compute_args=("--lease-ttl", str(LEASE_TTL)))
    received: list[int] = []
    nodes_seen: list[str] = []
    killed = None
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(request(tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True),
                             metadata=[("authorization", "Bearer sk-gold")], timeout=300)
        for chunk in call:
            received.extend(chunk.token_ids)
            if not nodes_seen or nodes_seen[-1] != chunk.node_id:
                nodes_seen.append(chunk.node_id)
            if killed is None and len(received) >= 20:
                killed = chunk.node_id
                cluster.kill_node(killed)
                killed_at = time.monotonic()
            last = chunk
    assert killed is not None and len(nodes_seen) == 2 and nodes_seen[0] == killed, nodes_seen
    assert received == expected  # nothing lost, nothing repeated, same greedy tokens
    assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), MAX_TOKENS)

    # The dead node's lease expires: it leaves etcd within its TTL (plus etcd's expiry tick).
    while killed in cluster.node_states():
        assert time.monotonic() - killed_at < LEASE_TTL + 2, "killed node still listed in etcd"
        time.sleep(0.1)
    # ... and block_service drops its pool: none of its blocks stay charged.
    deadline = time.monotonic() + 10
    while killed in (pools := block_pools(cluster)):
        assert time.monotonic() < deadline, f"block_service still holds {killed}'s pool: {pools[killed]}"
        time.sleep(0.1)
    assert set(pools) == {"node-0", "node-1"} - {killed}


def test_sigterm_drains_running_requests_then_leaves(start_cluster):
    cluster = start_cluster(2)
    prompt = random_prompt(24, seed=9)
    nodes_seen: set[str] = set()
    received: list[int] = []
    with grpc.insecure_channel(cluster.router_address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request(tokens=prompt, max_tokens=400, ignore_eos=True),
            metadata=[("authorization", "Bearer sk-gold")], timeout=300)
        draining = None
        for chunk in call:
            received.extend(chunk.token_ids)
            nodes_seen.add(chunk.node_id)
            if draining is None:
                draining = chunk.node_id
                cluster.kill_node(draining, signal.SIGTERM)
    assert nodes_seen == {draining} and len(received) == 400  # finished where it started
    assert cluster.nodes[draining].process.wait(30) == 0
    assert draining not in cluster.node_states()  # lease revoked, not left to expire
    assert draining not in block_pools(cluster)
    # New requests go to the node that is left.
    chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=3, ignore_eos=True))
    assert {c.node_id for c in chunks} == {"node-0", "node-1"} - {draining}
