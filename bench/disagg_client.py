"""bench/disagg.py's client side: one greedy request through the router's gRPC door, timed per token
as its chunks arrive (and which node sent each), and the servers' own counters of hand-overs and KV
fetched."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

API_KEY = "sk-bench"


@dataclass(slots=True)
class Outcome:
    name: str
    sent_at: float                                      # time.perf_counter() when it was sent
    times: list[float] = field(default_factory=list)    # when each token arrived (the same clock)
    tokens: list[int] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)      # the node that sent each token

    @property
    def ttft_s(self) -> float:
        return self.times[0] - self.sent_at if self.times else float("nan")

    @property
    def gaps_s(self) -> list[float]:
        """Per token after the first, the time since the token before (0 within one chunk)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]

    def shifted(self, origin: float) -> Outcome:
        """The same with its times counted from ``origin``."""
        return Outcome(self.name, self.sent_at - origin, [t - origin for t in self.times], self.tokens, self.nodes)


async def generate(stub, prompt: list[int], max_tokens: int, name: str = "", into: Outcome | None = None) -> Outcome:
    """One greedy request through the router, timed per token as its chunks arrive (into ``into``,
    which a caller may read while it runs)."""
    from kvfleet.v1 import inference_pb2

    request = inference_pb2.GenerateRequest(
        tokens=inference_pb2.TokenIds(ids=prompt),
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outcome = into or Outcome(name, time.perf_counter())
    async for chunk in stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=1800):
        now = time.perf_counter()
        outcome.times.extend([now] * len(chunk.token_ids))
        outcome.tokens.extend(chunk.token_ids)
        outcome.nodes.extend([chunk.node_id] * len(chunk.token_ids))
    return outcome


def server_figures(cluster) -> dict[str, float]:
    """The router's hand-overs and the nodes' KV fetches so far (counters summed over the nodes)."""
    from kvfleet.cli.node_direct import metric, node_metrics

    router = node_metrics(cluster, "router")
    nodes = [node_metrics(cluster, n) for n in cluster.nodes]
    figures = dict(handovers=metric(router, "kvfleet:router_handovers_total"),
                   handover_s=metric(router, "kvfleet:router_handover_seconds_sum"))
    for key, name in (("fetches", "kvfleet:kv_fetch_seconds_count"), ("fetch_s", "kvfleet:kv_fetch_seconds_sum"),
                      ("fetched_bytes", "kvfleet:kv_fetch_bytes_total"),
                      ("fetch_fallbacks", "kvfleet:kv_fetch_fallbacks_total")):
        figures[key] = sum(metric(s, name) for s in nodes)
    return figures


