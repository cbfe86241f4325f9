"""Requests written straight to one node's Serve stream, as the router writes them (under the
router's certificate), for the tests and benchmarks that must choose the node themselves; and a
node's metrics."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from dataclasses import dataclass

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.core import certs, rpc, tls
from kvfleet.core.identity import ROUTER_ID, Identity
from kvfleet.v1 import compute_pb2, compute_pb2_grpc


@dataclass(slots=True)
class NodeAnswer:
    tokens: list[int]
    cached_tokens: int
    error: str = ""
    ttft_s: float | None = None  # from the start command's write (the channel already up) to the first token


async def generate_on(cluster, node_id: str, request_id: str, prompt: list[int], max_tokens: int,
                      tenant: str = "gold", prefix_group: str = "") -> NodeAnswer:
    """One greedy request on node ``node_id`` of ``cluster`` (a LocalCluster), to its end
    (``prefix_group``: the tenant's, as the router would have decided it)."""
    as_router = tls.Credentials.load(certs.identity_dir(cluster.certs.root, ROUTER_ID), ROUTER_ID)
    request = compute_pb2.ComputeRequest(request_id=request_id, tenant=tenant, prompt_token_ids=prompt,
                                         prefix_group=prefix_group)
    request.sampling.max_tokens = max_tokens
    request.sampling.ignore_eos = True
    answer = NodeAnswer([], 0)
    address = f"127.0.0.1:{cluster.nodes[node_id].port}"
    async with rpc.channel(address, peer=Identity.node(node_id), credentials=as_router) as channel:
        await channel.channel_ready()  # the router's channels are up before its requests: TTFT leaves it out
        call = compute_pb2_grpc.ComputeStub(channel).Serve()
        sent = time.perf_counter()
        await call.write(compute_pb2.NodeCommands(commands=[compute_pb2.NodeCommand(start=request)]))
        while True:
            message = await call.read()
            if message is grpc.aio.EOF:
                answer.error = "the node ended the stream"
                break
            events = [e for e in message.events if e.request_id == request_id]
            for event in events:
                if event.HasField("error"):
                    answer.error = event.error.message
                    break
                if event.chunk.token_ids and answer.ttft_s is None:
                    answer.ttft_s = time.perf_counter() - sent
                answer.tokens += event.chunk.token_ids
                if event.chunk.HasField("usage") and not answer.cached_tokens:
                    answer.cached_tokens = event.chunk.usage.cached_tokens
            if answer.error or any(e.chunk.finish_reason for e in events):
                break
        await call.done_writing()
    return answer


def run_on(cluster, node_id: str, request_id: str, prompt: list[int], max_tokens: int = 8) -> NodeAnswer:
    return asyncio.run(generate_on(cluster, node_id, request_id, prompt, max_tokens))


def node_metrics(cluster, node_id: str) -> dict[tuple[str, frozenset], float]:
    """(sample name, its labels) -> value, from the node's Prometheus endpoint."""
    text = urllib.request.urlopen(cluster.metrics_urls[node_id], timeout=10).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)
