"""The cluster serves the public API: same tokens as the engine in-process, streamed, validated."""

from __future__ import annotations

import time

import grpc
import pytest

from compute_service.engine import EngineConfig, LLMEngine
from compute_service.sampling import SamplingParams
from kvfleet.v1 import inference_pb2, inference_pb2_grpc

from cluster_helpers import BLOCK_SIZE, random_prompt, request, stream, tokens_of

PROMPTS = [random_prompt(n, seed) for seed, n in enumerate([5, 16, 37, 70])]


@pytest.fixture(scope="module")
def reference(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    return [o.new_token_ids for o in outs]


def test_greedy_through_the_cluster_matches_the_engine(start_cluster, reference):
    cluster = start_cluster(2, with_block_service=False)
    for prompt, expected in zip(PROMPTS, reference):
        chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=24, ignore_eos=True))
        assert tokens_of(chunks) == expected
        last = chunks[-1]
        assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 24)
        assert all(c.finish_reason == inference_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert {c.node_id for c in chunks} <= {"node-0", "node-1"}


def test_tokens_stream_incrementally_and_errors_are_answers(start_cluster):
    cluster = start_cluster(1, with_block_service=False)
    chunks = stream(cluster.router_address, request(text="hello streaming world", max_tokens=40, ignore_eos=True))
    assert len(chunks) >= 10 and all(len(c.token_ids) <= 2 for c in chunks)
    assert chunks[0].request_id and all(c.request_id == chunks[0].request_id for c in chunks)
    assert "".join(c.text for c in chunks)  # text arrives with the tokens

    cases = [
        (request(text="x"), "sk-nope", grpc.StatusCode.UNAUTHENTICATED, "unknown API key"),
        (request(text="x"), "", grpc.StatusCode.UNAUTHENTICATED, "unknown API key"),
        (request(text="x", max_tokens=0), "sk-gold", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (request(), "sk-gold", grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing"),
        (request(tokens=[1, 99999]), "sk-gold", grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        (request(text="x", temperature=-1), "sk-gold", grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (request(text="x", top_p=1.5), "sk-gold", grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (request(tokens=[1] * 5000), "sk-gold", grpc.StatusCode.INVALID_ARGUMENT, "max_model_len"),
    ]
    for req, key, code, words in cases:
        with pytest.raises(grpc.RpcError) as info:
            stream(cluster.router_address, req, api_key=key)
        assert info.value.code() == code and words in info.value.details(), info.value.details()
    with grpc.insecure_channel(cluster.router_address) as channel:  # no metadata at all
        with pytest.raises(grpc.RpcError) as info:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(request(text="x"), timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The services survived every bad request.
    assert tokens_of(stream(cluster.router_address, request(text="still up", max_tokens=3, ignore_eos=True)))


def test_health_and_reflection(start_cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    cluster = start_cluster(1, with_block_service=False)
    with grpc.insecure_channel(cluster.router_address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="kvfleet.v1.Inference"), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert "kvfleet.v1.Inference" in names and "grpc.health.v1.Health" in names
