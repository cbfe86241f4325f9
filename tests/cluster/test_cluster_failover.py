"""A compute node dies mid-stream: the client still gets every token exactly once, and the text
it would have read had nothing failed."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import grpc
import pytest
from cluster_helpers import BLOCK_SIZE, block_pools, random_prompt, request, stream

from kvfleet.compute_service.engine.llm_engine import EngineConfig, LLMEngine
from kvfleet.core.ids import MAX_REQUEST_ID_LEN
from kvfleet.core.sampling import SamplingParams
from kvfleet.router.prefix_lookup import FORGET_GRACE_S
from kvfleet.v1 import inference_pb2, inference_pb2_grpc
from tests.compute_service.conftest import late_stop_string

pytestmark = pytest.mark.chaos  # each test kills or drains a node on purpose

MAX_TOKENS = 1200
LEASE_TTL = 3


@dataclass(slots=True)
class Failover:
    chunks: list[inference_pb2.GenerateChunk]
    killed: str          # the node that served the request first
    killed_at: float     # time.monotonic() when it died

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)


def generate_killing_its_node(cluster, req, after: int = 20) -> Failover:
    """``req`` streamed, its node SIGKILLed once ``after`` tokens arrived (the router resumes it on
    the other). Asserts that the request did move."""
    chunks = []
    killed, killed_at, received = None, 0.0, 0
    with grpc.insecure_channel(cluster.router_address) as channel:
        call = inference_pb2_grpc.InferenceStub(channel).Generate(
            req, metadata=[("authorization", "Bearer sk-gold")], timeout=300)
        for chunk in call:
            chunks.append(chunk)
            received += len(chunk.token_ids)
            if killed is None and received >= after:
                killed = chunk.node_id
                cluster.kill_node(killed)
                killed_at = time.monotonic()
    nodes_seen = [c.node_id for i, c in enumerate(chunks) if i == 0 or chunks[i - 1].node_id != c.node_id]
    assert killed is not None and nodes_seen == [killed, nodes_seen[-1]] and nodes_seen[-1] != killed, nodes_seen
    return Failover(chunks, killed, killed_at)


def test_sigkill_mid_stream_resumes_on_another_node(start_cluster, model_dir):
    prompt = random_prompt(40, seed=5)
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
    expected = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].new_token_ids
    del engine

    cluster = start_cluster(2, compute_args=("--lease-ttl", str(LEASE_TTL)))
    run = generate_killing_its_node(cluster, request(tokens=prompt, max_tokens=MAX_TOKENS, ignore_eos=True))
    killed, killed_at, last = run.killed, run.killed_at, run.chunks[-1]
    assert run.tokens == expected  # nothing lost, nothing repeated, same greedy tokens
    assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), MAX_TOKENS)

    # The dead node's lease expires: it leaves etcd within its TTL (plus etcd's expiry tick).
    while killed in cluster.node_states():
        assert time.monotonic() - killed_at < LEASE_TTL + 2, "killed node still listed in etcd"
        time.sleep(0.1)
    # ... and block_service drops its pool once the router's grace is over (a key gone is not yet a
    # node gone: kvfleet.router.prefix_lookup.FORGET_GRACE_S): none of its blocks stay charged.
    deadline = time.monotonic() + FORGET_GRACE_S + 10
    while killed in (pools := block_pools(cluster)):
        assert time.monotonic() < deadline, f"block_service still holds {killed}'s pool: {pools[killed]}"
        time.sleep(0.1)
    assert set(pools) == {"node-0", "node-1"} - {killed}


def test_a_request_id_of_the_longest_allowed_length_resumes_too(start_cluster):
    """A request id at the public limit gets the router's and the attempt's suffixes on failover:
    the node must take the resumed attempt's id (it refused a 130-character one with
    INVALID_ARGUMENT, and the client got that instead of its tokens)."""
    cluster = start_cluster(2)
    request_id = "r" * MAX_REQUEST_ID_LEN
    run = generate_killing_its_node(
        cluster, request(tokens=random_prompt(24, seed=13), max_tokens=200, ignore_eos=True, request_id=request_id))
    assert len(run.tokens) == 200 and run.chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert {c.request_id for c in run.chunks} == {request_id}


def test_a_stop_string_after_the_failover_point_cuts_the_text_as_without_a_failure(start_cluster, model_dir):
    prompt = random_prompt(40, seed=7)  # a seed whose greedy text has printable pairs late (many loop early)
    engine = LLMEngine(model_dir, EngineConfig(dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=16 << 20))
    free, early = (engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].new_text
                   for n in (400, 150))
    # past token 150: far past where the node is killed (20 tokens in, plus what is in flight then)
    stop = late_stop_string(free, start=len(early))
    expected = engine.generate([prompt], SamplingParams(max_tokens=400, stop=[stop], ignore_eos=True))[0]
    del engine
    assert expected.finish_reason == "stop"

    cluster = start_cluster(2)
    run = generate_killing_its_node(cluster, request(tokens=prompt, max_tokens=400, ignore_eos=True, stop=[stop]))
    assert run.tokens == expected.new_token_ids
    assert run.text == expected.new_text  # cut before the stop string, nothing held back lost
    assert run.chunks[-1].finish_reason == inference_pb2.FINISH_REASON_STOP


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
