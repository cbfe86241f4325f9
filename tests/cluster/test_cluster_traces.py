"""One trace per request, from the router through a compute node to block_service."""

from __future__ import annotations

import time

from cluster_helpers import random_prompt, request, stream
from otlp_receiver import OtlpReceiver


def test_one_trace_spans_router_compute_and_block_service(start_cluster):
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
        cluster = start_cluster(1, env=env)
        chunks = stream(cluster.router_address, request(tokens=random_prompt(40, 3), max_tokens=5, ignore_eos=True))
        cluster.stop()  # every process flushes its spans on the way out
        time.sleep(0.5)
        spans = list(receiver.spans)

    by_id = {s.span_id: s for s in spans}
    [root] = [s for s in spans if s.name == "/kvfleet.v1.Inference/Generate" and s.service == "kvfleet-router"]
    trace = [s for s in spans if s.trace_id == root.trace_id]
    names = {(s.service, s.name) for s in trace}

    def parent(span):
        return by_id.get(span.parent_id)

    assert root.parent_id == "" and root.attributes["kvfleet.tenant"] == "gold"
    assert root.attributes["kvfleet.completion_tokens"] == 5
    for name in ("queue", "route"):
        [s] = [s for s in trace if s.name == name]
        assert parent(s) is root
    [route] = [s for s in trace if s.name == "route"]
    assert route.attributes["kvfleet.node_id"] == chunks[-1].node_id
    # router's span of the attempt → the node's span of the request (its context crossed the shared
    # Serve stream inside the start command) → prefill / decode
    [call] = [s for s in trace if s.service == "kvfleet-router" and s.name == "compute"]
    [served] = [s for s in trace if s.service == "kvfleet-compute" and s.name == "generate"]
    assert parent(call) is root and parent(served) is call
    assert call.attributes["kvfleet.node_id"] == served.attributes["kvfleet.node_id"] == chunks[-1].node_id
    # the long-lived stream itself is not traced: it belongs to no request
    assert not [s for s in spans if s.name.endswith("Compute/Serve")]
    assert served.attributes["kvfleet.tenant"] == "gold" and served.attributes["kvfleet.prompt_tokens"] == 40
    prefill, decode = ([s for s in trace if s.name == n] for n in ("prefill", "decode"))
    assert parent(prefill[0]) is served and parent(decode[0]) is served
    # compute → block_service: the allocation of this request's blocks is in the same trace
    allocations = [s for s in trace if s.service == "kvfleet-compute" and s.name.endswith("BlockManager/AllocateMany")]
    assert allocations and all(parent(a) is prefill[0] for a in allocations), names
    # block_service's server span of that allocation is its child, in the same trace
    served_by_block = [s for s in trace if s.service == "kvfleet-block-service" and s.name.endswith("AllocateMany")]
    assert served_by_block and all(parent(s) in allocations for s in served_by_block), names

    # The node's write-behind bookkeeping (ApplyMany: this request's commits and its release, batched
    # with other requests' when there are any) is a trace of its own, linked to each request it carries:
    # every batch sent after this request started (the warm-up's came before) links to its prefill span.
    batches = [s for s in spans if s.service == "kvfleet-compute" and s.name == "bookkeeping"]
    after = [b for b in batches if b.start_ns > root.start_ns]
    assert after and all((prefill[0].trace_id, prefill[0].span_id) in b.links for b in after), after
    assert sum(b.attributes["kvfleet.num_commits"] for b in after) >= 1  # 40 tokens: full blocks committed
    assert sum(b.attributes["kvfleet.num_releases"] for b in after) == 1  # and released at the end
    # each batch: node's span → its ApplyMany client span → block_service's server span; no ApplyMany
    # is a lone trace any more
    for batch in batches:
        assert batch.parent_id == ""
        [client] = [s for s in spans if s.parent_id == batch.span_id]
        assert client.name.endswith("BlockManager/ApplyMany") and client.trace_id == batch.trace_id
    applied = [s for s in spans if s.service == "kvfleet-block-service" and s.name.endswith("ApplyMany")]
    assert applied and all(parent(s) is not None and parent(parent(s)) in batches for s in applied), names


def test_the_http_door_traces_its_requests_as_the_grpc_door_does(start_cluster):
    """One path, two doors: an OpenAI request's trace has the same queue, route and compute spans,
    under the HTTP request's span, with the node's spans below, streaming or not."""
    import httpx2 as httpx

    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
               "OTEL_BSP_SCHEDULE_DELAY": "100"}
        cluster = start_cluster(1, env=env)
        for streaming in (False, True):
            answer = httpx.post(cluster.http_url + "/completions", headers={"authorization": "Bearer sk-gold"},
                                json={"model": "tiny", "prompt": random_prompt(40, 3), "max_tokens": 5,
                                      "ignore_eos": True, "stream": streaming}, timeout=60)
            assert answer.status_code == 200
        cluster.stop()
        time.sleep(0.5)
        spans = list(receiver.spans)

    by_id = {s.span_id: s for s in spans}
    requests = [s for s in spans if s.name == "openai completion" and s.service == "kvfleet-router"]
    assert len(requests) == 2
    for request_span in requests:
        trace = [s for s in spans if s.trace_id == request_span.trace_id]
        [root] = [s for s in trace if not s.parent_id]
        assert root.service == "kvfleet-router"  # the HTTP request's own span (FastAPI's), or this one
        assert request_span.attributes["kvfleet.tenant"] == "gold"
        assert request_span.attributes["kvfleet.completion_tokens"] == 5
        for name in ("queue", "route", "compute"):
            [s] = [s for s in trace if s.name == name and s.service == "kvfleet-router"]
            assert by_id[s.parent_id] is request_span
        [call] = [s for s in trace if s.service == "kvfleet-router" and s.name == "compute"]
        [served] = [s for s in trace if s.service == "kvfleet-compute" and s.name == "generate"]
        assert by_id[served.parent_id] is call
