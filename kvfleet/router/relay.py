"""Relaying one request's token stream from compute nodes to the client, surviving node failures.

    attempt: route (prefix lookup + NodePicker) → start on the node's Serve stream (prompt + tokens
             sent so far) → forward each chunk → on a node failure, exclude the node and attempt again

A failure before the first token is a plain retry. A failure mid-stream resumes on another node
from the prompt plus every token already forwarded (marked as output already delivered, with the
client's sampling unchanged), so the client sees each token exactly once and the new node's engine
counts ``max_tokens`` and finds stop strings over the whole output; under greedy sampling the
resumed run produces exactly the tokens and text the uninterrupted run would have. A node that goes
silent for ``stall_timeout_s`` counts as failed too; while it prefills a long prompt it sends an
empty chunk after each prefill chunk, heard here and not forwarded.

Which node errors are answers for the client and which are the node's problem (another node is
tried) is policy, in ``kvfleet/router/resume.py``; this module only moves the messages.

With prefill nodes in the cluster (``kvfleet/router/disagg.py``), a long uncached prompt's first attempt
goes to a prefill node for its first token only; then, as for a resume, the sequence continues on a
decode-capable node from prompt + that token, which fetches the prompt's KV from the prefill node
(``kv_source_node_id``) instead of computing it. The client sees one stream, every token once.

Each attempt has a ``compute`` span (kind CLIENT) whose context travels in the start command, so
the node's spans for the request join the request's trace.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import grpc
from opentelemetry import propagate, trace

from kvfleet.core.ids import MAX_ATTEMPTS
from kvfleet.core.latency_histogram import LatencyHistogram
from kvfleet.core.tenants import Tenant
from kvfleet.core.wire import sampling_to_proto
from kvfleet.router.canary_split import in_group
from kvfleet.router.disagg import DisaggConfig, hand_over, prefill_nodes, serving_nodes
from kvfleet.router.node_stream import NodeFailure
from kvfleet.router.nodes import NodeTable, RouterNode
from kvfleet.router.pinning import PinRefused, pin_prompt
from kvfleet.router.request import ParsedRequest
from kvfleet.router.resume import Progress, is_client_answer
from kvfleet.router.routing import NO_HIT, NodePicker, PrefixHit
from kvfleet.router.stall_watch import StallWatch
from kvfleet.v1 import compute_pb2, inference_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)


def end_of_turn(token_ids, finish_reason, stop_token_ids):
    """A node stops at its model's ``config.json`` eos only; the router ends the request at the
    first of the model's other end-of-turn tokens too (``generation_config.json``, the tokenizer's
    eos), as ``transformers`` would: (the tokens up to and including it, FINISH_REASON_STOP)."""
    for i, token in enumerate(token_ids):
        if token in stop_token_ids:
            return list(token_ids[:i + 1]), inference_pb2.FINISH_REASON_STOP
    return token_ids, finish_reason


def _held_tokens(node: RouterNode, hit: PrefixHit) -> int:
    """The prompt's tokens ``node`` holds (pool or lower tier): what it need not prefill."""
    return (hit.hot + hit.lower) * node.info.block_size


class RelayError(Exception):
    """The request cannot be served; ``code`` is the gRPC status for the client."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def given_up(req: ParsedRequest, progress: Progress, why: str) -> RelayError:
    """The client's answer once no node is left to try: what happened, and what the last node said."""
    return RelayError(grpc.StatusCode[progress.given_up_status()],
                      f"request {req.request_id} {why}; last: {progress.last_failure}")


class NodeStalled(Exception):
    """A node sent nothing for too long: treated like a node that died."""


class PrefixLookup(Protocol):
    async def match(self, tenant: str, token_ids: Sequence[int], nodes: Sequence[RouterNode],
                    prefix_group: str = "") -> dict[str, PrefixHit]:
        """Per node id, how many leading full blocks of ``token_ids`` are (about to be) cached there,
        hot and, past those, in a lower tier (the chain salted with ``prefix_group`` when given)."""

    def routed(self, tenant: str, token_ids: Sequence[int], node: RouterNode, prefix_group: str = "") -> None:
        """``token_ids`` were just sent to ``node``."""


class Relay:
    def __init__(self, nodes: NodeTable, picker: NodePicker, prefix: PrefixLookup, max_attempts: int = 4,
                 stall_timeout_s: float = 120.0, disagg: DisaggConfig = DisaggConfig()):
        if not 1 <= max_attempts <= MAX_ATTEMPTS:  # each attempt's id must fit the id budget
            raise ValueError(f"max_attempts must be 1..{MAX_ATTEMPTS}, got {max_attempts}")
        self.stall_timeout_s = stall_timeout_s
        self.nodes = nodes
        self.picker = picker
        self.prefix = prefix
        self.max_attempts = max_attempts
        self.disagg = disagg
        self.handovers = 0  # hand-overs from a prefill node begun (metrics)
        # per hand-over, from the prefill node's first token to the decode node's next one (metrics)
        self.handover_seconds = LatencyHistogram()

    async def _route(self, req: ParsedRequest, tenant: Tenant, ids: list[int],
                     progress: Progress, group: str | None = None) -> tuple[RouterNode, int, bool]:
        """The node for this attempt, how many of the prompt's leading blocks it holds, and whether
        it only prefills (the sequence is handed over after its first token); among ``group``'s side
        of a canary split (``kvfleet/router/canary_split.py``) while that side has a candidate."""
        with tracer.start_as_current_span("route") as span:
            ready = in_group([n for n in self.nodes.ready() if n.node_id not in progress.excluded], group)
            if not ready:
                if progress.excluded:
                    raise given_up(req, progress, f"failed on {sorted(progress.excluded)}, no READY compute node left")
                raise RelayError(grpc.StatusCode.UNAVAILABLE, "no READY compute node")
            prefill, serving = prefill_nodes(ready), serving_nodes(ready)
            cached: dict[str, PrefixHit] = {}
            if len(ready) > 1:  # one candidate is the answer whatever is cached where
                try:
                    cached = await self.prefix.match(tenant.name, ids, ready, prefix_group=tenant.prefix_group or "")
                except Exception as e:  # routing without prefix knowledge still serves the request
                    log.warning("prefix lookup failed, routing by load only: %s", e)
            best = max((_held_tokens(n, cached.get(n.node_id, NO_HIT)) for n in serving), default=0)
            only_prefill = hand_over(self.disagg, len(ids), best, len(prefill), len(serving),
                                     len(progress.sent), req.sampling.max_tokens, bool(progress.source))
            candidates = prefill if only_prefill else serving or prefill  # only prefill nodes left: they serve
            span.set_attribute("kvfleet.prefill_only", only_prefill)
            loads = [n.load(cached.get(n.node_id, NO_HIT)) for n in candidates]
            num_blocks = candidates[0].full_blocks(len(ids))
            decision = self.picker.choose(loads, num_blocks, self.nodes.clock())
            span.set_attribute("kvfleet.node_id", decision.node_id)
            span.set_attribute("kvfleet.route_reason", decision.reason)
            span.set_attribute("kvfleet.cached_prefix_blocks", decision.cached_prefix_blocks)
            hit = cached.get(decision.node_id, NO_HIT)
            span.set_attribute("kvfleet.lower_tier_prefix_blocks", hit.lower)
            span.set_attribute("kvfleet.peer_prefix_blocks", hit.peer)
            span.set_attribute("kvfleet.num_candidates", len(candidates))
            # the candidate itself, not the membership's entry: its key may have left etcd while the
            # prefix lookup was awaited (an etcd outage past the leases), and a departed node's stream
            # still serves (Nodes.departed) or fails this attempt the usual way
            node = next(n for n in candidates if n.node_id == decision.node_id)
            self.prefix.routed(tenant.name, ids, node, prefix_group=tenant.prefix_group or "")
            return node, decision.cached_prefix_blocks, only_prefill

    async def run(self, req: ParsedRequest, tenant: Tenant,
                  group: str | None = None) -> AsyncIterator[inference_pb2.GenerateChunk]:
        progress = Progress(req.prompt_ids, req.sampling.max_tokens)
        handed_at: float | None = None
        pinned: int | None = None  # the prompt's tokens pinned (cache.pin), on the first attempt's node
        while True:
            if progress.remaining <= 0:  # the node died after the last token but before saying so
                yield self._last_chunk(req, progress, "", inference_pb2.FINISH_REASON_LENGTH)
                return
            ids = progress.next_prompt
            node, cached_blocks, only_prefill = await self._route(req, tenant, ids, progress, group)
            if req.pin is not None and pinned is None:  # before dispatch: a refusal is the answer
                try:
                    pinned = await pin_prompt(self.prefix, req.pin, tenant, req.prompt_ids, node)
                except PinRefused as e:
                    raise RelayError(grpc.StatusCode[e.code], str(e)) from None
            try:
                async with contextlib.aclosing(self._attempt(node, req, tenant, ids, progress, cached_blocks,
                                                             only_prefill)) as chunks:
                    async for chunk in chunks:
                        if handed_at is not None and (chunk.token_ids or chunk.finish_reason):
                            self.handover_seconds.observe(time.monotonic() - handed_at)
                            handed_at = None
                        if pinned and chunk.HasField("usage"):
                            chunk.usage.pinned_tokens = pinned
                        yield chunk
                        if chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                            return
                if only_prefill and progress.sent:  # its first token is out: the hand-over
                    progress.handed_over(node.node_id)
                    self.handovers += 1
                    handed_at = time.monotonic()
                    trace.get_current_span().add_event("handover", {"kvfleet.node_id": node.node_id})
                    continue
                failure, status = "stream ended without a finish", ""
            except NodeFailure as e:
                failure, status = self._classify(e), e.code.name
            except NodeStalled as e:
                failure, status = str(e), ""
            progress.failed(node.node_id, failure, status)
            if status != "INTERNAL":  # its engine raised on this request: the node itself answers, it stays routable
                self.nodes.mark_failed(node.node_id)
            log.warning("request %s: node %s failed after %d tokens (%s); %s", req.request_id, node.node_id,
                        len(progress.sent), failure, "resuming" if progress.sent else "retrying")
            trace.get_current_span().add_event("node_failed", {"kvfleet.node_id": node.node_id,
                                                               "kvfleet.tokens_sent": len(progress.sent)})
            if progress.attempts >= self.max_attempts:
                raise given_up(req, progress, f"failed on {progress.attempts} nodes")

    @staticmethod
    def _classify(e: NodeFailure) -> str:
        """Raise ``RelayError`` for an answer meant for the client; return a description for a
        node failure."""
        if is_client_answer(e.code.name, e.refusal):
            raise RelayError(e.code, e.details or e.code.name)
        return str(e)

    async def _attempt(
        self, node: RouterNode, req: ParsedRequest, tenant: Tenant, ids: list[int], progress: Progress,
        cached_blocks: int = 0, only_prefill: bool = False,
    ) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """One attempt's chunks; ``only_prefill``: the node stops after the first token, and the
        attempt ends without a last chunk when that is not the request's end (the hand-over)."""
        message = compute_pb2.ComputeRequest(
            request_id=progress.attempt_id(req.seq_id),
            tenant=tenant.name, priority=tenant.paid_level,
            prompt_token_ids=ids, num_resumed_tokens=len(progress.sent), kv_source_node_id=progress.source,
            prefix_group=tenant.prefix_group or "",  # the router's decision (the API key's tenant), on every attempt
        )
        sampling_to_proto(req.sampling, message.sampling)  # max_tokens counts the resumed tokens too
        if only_prefill:
            message.sampling.max_tokens = 1
        span = tracer.start_span("compute", kind=trace.SpanKind.CLIENT,
                                 attributes={"kvfleet.node_id": node.node_id, "kvfleet.attempt": progress.attempts})
        propagate.inject(message.trace_context, context=trace.set_span_in_context(span))
        inbox = node.start(req.seq_id, message, cached_blocks)
        watch = StallWatch(inbox, NodeStalled(f"no token from node {node.node_id} for {self.stall_timeout_s:g}s"),
                           self.stall_timeout_s)
        over = False  # the node is done with it (finished, refused, or its stream broke)
        try:
            while True:
                event = await inbox.get()
                watch.heard()
                if isinstance(event, NodeFailure):
                    over = True
                    raise event
                if isinstance(event, NodeStalled):
                    raise event
                if event.HasField("error"):
                    over = True
                    raise NodeFailure.from_event(event.error)
                chunk = event.chunk
                if not (chunk.token_ids or chunk.text or chunk.finish_reason):
                    continue  # the node's prefill progress: it is alive (heard above), nothing to relay
                token_ids, reason = end_of_turn(chunk.token_ids, chunk.finish_reason, req.stop_token_ids)
                handover = only_prefill and reason == inference_pb2.FINISH_REASON_LENGTH and \
                    progress.remaining > len(token_ids)
                if handover:  # the limit was the hand-over's, not the client's
                    reason = inference_pb2.FINISH_REASON_UNSPECIFIED
                progress.relayed(token_ids, chunk.usage.cached_tokens if chunk.HasField("usage") else None)
                node.hold_seq(req.seq_id, len(req.prompt_ids) + len(progress.sent), decoding=True)
                if reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    over = chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED  # else cancelled
                    yield self._last_chunk(req, progress, chunk.text, reason, token_ids, node)
                    return
                yield inference_pb2.GenerateChunk(
                    request_id=req.request_id, token_ids=chunk.token_ids, text=chunk.text, node_id=node.node_id
                )
                if handover:
                    over = True  # the node finished its part
                    return
        except NodeFailure as e:
            span.set_status(trace.StatusCode.ERROR, str(e))
            raise
        finally:
            watch.stop()
            self.nodes.finish(node, req.seq_id, message.request_id, cancel=not over)  # cancel: the client left or it stalled
            span.set_attribute("kvfleet.tokens", len(progress.sent))
            span.end()

    def _last_chunk(self, req, progress, text, reason, token_ids=(), node: RouterNode | None = None):
        span = trace.get_current_span()
        span.set_attribute("kvfleet.prompt_tokens", len(req.prompt_ids))
        span.set_attribute("kvfleet.completion_tokens", len(progress.sent))
        span.set_attribute("kvfleet.resumes", progress.attempts)
        return inference_pb2.GenerateChunk(
            request_id=req.request_id, token_ids=token_ids, text=text, finish_reason=reason,
            node_id=node.node_id if node else "",
            usage=inference_pb2.Usage(
                prompt_tokens=len(req.prompt_ids), completion_tokens=len(progress.sent),
                cached_tokens=progress.cached_tokens or 0,
            ),
        )
