"""``kvfleet compute --kv-layout contiguous`` in a one-node cluster (router → node → block_service):
the tokens of the in-process paged engine, each request charged its whole reservation at
block_service while it runs (no reserve block past it), no prefix cache hit, nothing left after."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from cluster_helpers import BLOCK_SIZE, block_pools, random_prompt, released_pool, request, stream, tokens_of

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core.sampling import SamplingParams
from kvfleet.v1 import inference_pb2_grpc

MAX_LEN = 256
RESERVATION = MAX_LEN // BLOCK_SIZE
PROMPTS = [random_prompt(n, seed) for seed, n in enumerate([7, 40, 90])]


def test_contiguous_node_serves_paged_tokens_with_whole_reservations(start_cluster, model_dir):
    expected = [o.new_token_ids for o in LLMEngine(model_dir, EngineConfig(
        dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
                .generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    cluster = start_cluster(1, compute_args=("--kv-layout", "contiguous", "--max-model-len", str(MAX_LEN)))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        chunks = list(pool.map(lambda p: stream(cluster.router_address, request(tokens=p, max_tokens=12,
                                                                                 ignore_eos=True)), PROMPTS))
    assert [tokens_of(c) for c in chunks] == expected
    again = stream(cluster.router_address, request(tokens=PROMPTS[2], max_tokens=12, ignore_eos=True))
    assert tokens_of(again) == expected[2] and again[-1].usage.cached_tokens == 0  # no prefix sharing

    with grpc.insecure_channel(cluster.router_address) as channel:  # one request held open mid-stream
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request(tokens=PROMPTS[0], max_tokens=200, ignore_eos=True), metadata=[("authorization", "Bearer sk-gold")])
        next(call)
        node = block_pools(cluster)["node-0"]
        assert (node.num_sequences, node.num_used) == (1, RESERVATION)
        call.cancel()
    node = released_pool(cluster)
    assert node.num_cached == 0  # nothing was committed for reuse
