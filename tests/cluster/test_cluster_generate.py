"""The cluster serves the public API: same tokens as the engine in-process, streamed, validated.
Tests that only send requests and read answers share the module's clusters (``shared_cluster``)."""

from __future__ import annotations

import grpc
import pytest
from cluster_helpers import (
    BLOCK_SIZE,
    random_prompt,
    released_pool,
    request,
    stream,
    tokens_of,
)

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core import rpc
from kvfleet.core.identity import BLOCK_SERVICE_ID, Identity
from kvfleet.core.sampling import SamplingParams
from kvfleet.v1 import inference_pb2, inference_pb2_grpc

PROMPTS = [random_prompt(n, seed) for seed, n in enumerate([5, 16, 37, 70])]


@pytest.fixture(scope="module")
def reference(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    return [o.new_token_ids for o in outs]


def test_greedy_through_the_cluster_matches_the_engine(shared_cluster, reference):
    cluster = shared_cluster(2)
    for prompt, expected in zip(PROMPTS, reference):
        chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=24, ignore_eos=True))
        assert tokens_of(chunks) == expected
        last = chunks[-1]
        assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 24)
        assert all(c.finish_reason == inference_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert {c.node_id for c in chunks} <= {"node-0", "node-1"}


def test_clients_on_the_machine_reach_the_router_over_its_unix_socket(shared_cluster, reference):
    cluster = shared_cluster(1)
    assert cluster.router_unix_address.startswith("unix:")
    chunks = stream(cluster.router_unix_address, request(tokens=PROMPTS[2], max_tokens=24, ignore_eos=True))
    assert tokens_of(chunks) == reference[2] and chunks[-1].usage.completion_tokens == 24


def test_a_stream_interval_groups_tokens_and_changes_nothing_else(start_cluster, reference):
    cluster = start_cluster(1, compute_args=("--stream-interval", "5"))
    for prompt, expected in zip(PROMPTS, reference):
        chunks = stream(cluster.router_address, request(tokens=prompt, max_tokens=24, ignore_eos=True))
        assert tokens_of(chunks) == expected
        # 5 tokens a chunk, the last one 4; a busy machine may merge unsent chunks, never split them
        sizes = [len(c.token_ids) for c in chunks]
        assert all(n % 5 == 0 for n in sizes[:-1]) and sizes[-1] % 5 == 4 and len(sizes) >= 2
        assert chunks[-1].usage.completion_tokens == 24


def test_tokens_stream_incrementally_and_errors_are_answers(shared_cluster):
    cluster = shared_cluster(1)
    chunks = stream(cluster.router_address, request(text="hello streaming world", max_tokens=40, ignore_eos=True))
    # one chunk per step while the router keeps up; a busy machine merges a request's unsent chunks
    # (serve_session.py), so only "more than one" holds whatever the load
    assert len([c for c in chunks if c.token_ids]) >= 2 and len(tokens_of(chunks)) == 40
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


def test_health_and_reflection(shared_cluster):
    """Every kvfleet server answers the gRPC health service and lists its services by reflection
    (what Kubernetes' grpc probes and grpcurl need): the router, the node and block_service."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    cluster = shared_cluster(1)
    [node_id] = cluster.node_states()
    servers = {cluster.router_address: ("kvfleet.v1.Inference", None),  # the public door
               f"127.0.0.1:{cluster.child(node_id).port}": ("kvfleet.v1.Compute", Identity.node(node_id)),
               cluster.block_service_address: ("kvfleet.v1.BlockManager", BLOCK_SERVICE_ID)}
    for address, (service, peer) in servers.items():
        with rpc.sync_channel(address, peer=peer) as channel:  # this process is the cluster's admin
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo
            [listed] = reflect(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            names = {s.name for s in listed.list_services_response.service}
            assert names == {service, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}, address
            # the service's own descriptors come back: a client needs no .proto file to call it
            [found] = reflect(iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=service)]), timeout=10)
            assert found.file_descriptor_response.file_descriptor_proto, service


def test_a_cached_prefix_is_routed_to_its_node(shared_cluster):
    cluster = shared_cluster(2)
    for seed in range(4):
        prefix = random_prompt(6 * BLOCK_SIZE, seed=100 + seed)
        first = stream(cluster.router_address, request(tokens=prefix + [1, 2, 3], max_tokens=2, ignore_eos=True))
        home = first[-1].node_id
        again = stream(cluster.router_address, request(tokens=prefix + [7, 8, 9, 10], max_tokens=2, ignore_eos=True))
        assert again[-1].node_id == home
        assert again[-1].usage.cached_tokens == 6 * BLOCK_SIZE


def test_a_burst_sharing_a_prefix_lands_on_one_node(start_cluster):
    """Sent together, before any of them has committed a block: the router's own recent routes
    keep them on one node (block_service cannot know the prefix yet). With a prefix weight of 4 an
    uncached 7-block prompt (28) costs more than two such requests in flight (14, below the
    hot-spot guard's 16-block margin); without recent routes every node would look cold and the
    three would spread by load."""
    from concurrent.futures import ThreadPoolExecutor

    cluster = start_cluster(2, router_args=("--prefix-weight", "4"))
    for seed in range(3):
        prefix = random_prompt(6 * BLOCK_SIZE, seed=200 + seed)
        with ThreadPoolExecutor(3) as pool:
            runs = list(pool.map(lambda tail: stream(cluster.router_address, request(
                tokens=prefix + tail, max_tokens=2, ignore_eos=True)), ([1], [2, 3], [4, 5, 6])))
        assert len({chunks[-1].node_id for chunks in runs}) == 1


def test_a_tenant_over_quota_is_refused_while_others_are_served(shared_cluster):
    import threading

    cluster = shared_cluster(2)
    gold: list = []
    worker = threading.Thread(target=lambda: gold.extend(
        stream(cluster.router_address, request(tokens=random_prompt(30, 1), max_tokens=300, ignore_eos=True))))
    worker.start()
    # "tiny" may hold 0.1 MiB: 3 blocks of this model; the prompt needs 7.
    with pytest.raises(grpc.RpcError) as info:
        stream(cluster.router_address, request(tokens=random_prompt(100, 2), max_tokens=4), api_key="sk-tiny")
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tenant 'tiny'" in info.value.details() and "quota" in info.value.details()
    worker.join(120)
    assert len(tokens_of(gold)) == 300
    # A small request of the same tenant still fits its quota.
    assert tokens_of(stream(cluster.router_address, request(tokens=[5, 6, 7], max_tokens=3, ignore_eos=True),
                            api_key="sk-tiny"))


def test_a_client_that_leaves_mid_stream_frees_its_blocks(shared_cluster):
    cluster = shared_cluster(1)
    with grpc.insecure_channel(cluster.router_address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            request(tokens=random_prompt(50, 4), max_tokens=2000, ignore_eos=True),
            metadata=[("authorization", "Bearer sk-gold")], timeout=120)
        for i, _ in enumerate(call):
            if i == 5:
                call.cancel()
                break
    released_pool(cluster)
