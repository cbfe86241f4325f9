"""A compute node dies mid-stream: the client still gets every token exactly once."""

from __future__ import annotations

import time

import grpc

from compute_service.engine import EngineConfig, LLMEngine
from compute_service.sampling import SamplingParams
from kvfleet.v1 import inference_pb2, inference_pb2_grpc

from cluster_helpers import BLOCK_SIZE, random_prompt, request

MAX_TOKENS = 1200
LEASE_TTL = 3


def test_sigkill_mid_stream_resumes_on_another_node(start_cluster, model_dir):
    prompt = random_prompt(40, seed=5)
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
    expected = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].new_token_ids
    del engine

    cluster = start_cluster(2, with_block_service=False, compute_args=("--lease-ttl", str(LEASE_TTL)))
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
