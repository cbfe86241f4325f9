"""Who is served first (paid level under contention) and where (a node that just joined gets a small share)."""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import pytest
from cluster_helpers import random_prompt, request, stream
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.v1 import inference_pb2_grpc

SAMPLE = 40


def queued(cluster) -> float:
    """Requests waiting in the router's queue, all tenants (its Prometheus gauge)."""
    text = urllib.request.urlopen(cluster.metrics_urls["router"], timeout=30).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvfleet:router_queue_depth")


def test_higher_paid_level_is_served_first_under_contention(start_cluster):
    """A blocker holds the router's only slot; two free then two gold requests arrive, each once the
    router has queued the one before; the blocker is cancelled: gold goes first, each level in its
    order of arrival."""
    cluster = start_cluster(1, router_args=("--capacity", "1"))
    finished: list[str] = []
    ended: dict[str, grpc.StatusCode] = {}
    calls: dict[str, grpc.Future] = {}
    lock = threading.Lock()

    def run(name: str, key: str, max_tokens: int, first_token: threading.Event | None = None) -> None:
        with grpc.insecure_channel(cluster.router_address) as channel:
            call = inference_pb2_grpc.InferenceStub(channel).Generate(
                request(tokens=random_prompt(20, hash(name) % 1000), max_tokens=max_tokens, ignore_eos=True),
                metadata=[("authorization", f"Bearer {key}")], timeout=120)
            calls[name] = call
            try:
                for _ in call:
                    if first_token is not None:
                        first_token.set()
            except grpc.RpcError as e:
                ended[name] = e.code()
                return
        with lock:
            finished.append(name)
            ended[name] = grpc.StatusCode.OK

    running = threading.Event()
    blocker = threading.Thread(target=run, args=("blocker", "sk-free", 2000, running))
    blocker.start()
    assert running.wait(60)
    threads = []
    for i, (name, key) in enumerate([("free1", "sk-free"), ("free2", "sk-free"), ("gold1", "sk-gold"),
                                     ("gold2", "sk-gold")]):
        threads.append(threading.Thread(target=run, args=(name, key, 4)))
        threads[-1].start()
        deadline = time.monotonic() + 60  # arrive in this order, all while the blocker holds the slot
        while queued(cluster) < i + 1:
            assert time.monotonic() < deadline and blocker.is_alive(), f"{name} was not queued"
            time.sleep(0.05)
    calls["blocker"].cancel()  # the slot frees with all four waiting
    for t in [blocker, *threads]:
        t.join(120)
    assert ended["blocker"] == grpc.StatusCode.CANCELLED
    assert finished == ["gold1", "gold2", "free1", "free2"], ended


@pytest.mark.chaos  # it kills and restarts the router
def test_a_node_that_joins_gets_a_cold_start_share(start_cluster):
    """A node that turns READY while the router runs gets a small share of the traffic at first; a
    router that finds it READY when it starts treats it as warm and splits traffic evenly. (How the
    share ramps with time is the policy's, tested in tests/router/test_routing.py.)"""
    # a ramp far longer than the test: what the new node gets early cannot depend on machine speed
    cluster = start_cluster(1, router_args=("--warmup-s", "3600"))
    cluster.add_node("node-new")

    def node_of(i: int) -> str:
        return stream(cluster.router_address, request(tokens=random_prompt(8, i), max_tokens=1))[-1].node_id

    # the router has seen the new node once it routes a request there (a share of ~5% per request)
    assert any(node_of(i) == "node-new" for i in range(500))
    early = [node_of(1000 + i) for i in range(SAMPLE)].count("node-new") / SAMPLE

    cluster.kill("router")
    cluster.restart("router")  # same port, same flags: both nodes are READY when it starts
    cluster.wait_router()
    late = [node_of(2000 + i) for i in range(SAMPLE)].count("node-new") / SAMPLE
    # Candidate probability 0.1 (then an idle tie, split at random) against 1 for a warm node.
    assert early < 0.3 and late > 0.25 and late > early, (early, late)
