"""One request on a router's Serve stream, from its start command to its last event.

    start command → checks → spans (in the router's trace) → the prefix from a peer (prefix_fetch.py)
    → early block allocation → engine
    engine outputs → ``RequestEvent``s (up to ``stream_interval`` tokens per chunk) → the stream
    (a prefill chunk that samples no token yet → an empty chunk: the router hears the node is alive)
    finish, refusal, cancel or the stream ending → spans closed, unclaimed early blocks released, the
    node's in-flight count down

The request runs under a ``generate`` span (kind SERVER) whose parent is the router's span for
this attempt, taken from the start command's ``trace_context``; under it a ``prefill`` span (until
the first token; block_service calls for the request join it) and a ``decode`` span (the rest).

A resumed request (its node failed mid-stream; ``num_resumed_tokens`` of ``prompt_token_ids`` are
output already delivered) goes to the engine as what it is: a prompt and output generated so far.
The engine's stop checker, ``max_tokens`` count and detokenizer then see the whole output, so the
text that follows is exactly what the client would have read without the failure.

A block refusal (the engine aborts a request whose blocks were refused) ends the request with
RESOURCE_EXHAUSTED and the refusal's reason: a quota is the tenant's problem, a full pool is this
node's, and the router retries a full pool elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
from opentelemetry import propagate, trace

from kvfleet.compute_service.engine.request_output import RequestOutput
from kvfleet.compute_service.node.context import NodeContext
from kvfleet.core.ids import MAX_ID_LEN
from kvfleet.core.membership import NodeState
from kvfleet.core.wire import InvalidRequest, sampling_from_proto
from kvfleet.v1 import compute_pb2, inference_pb2

log = logging.getLogger(__name__)

tracer = trace.get_tracer(__name__)

FINISH = {
    "stop": inference_pb2.FINISH_REASON_STOP,
    "length": inference_pb2.FINISH_REASON_LENGTH,
    "abort": inference_pb2.FINISH_REASON_ABORT,
}

Emit = Callable[[compute_pb2.RequestEvent], None]


def check_request(request: compute_pb2.ComputeRequest) -> tuple[list[int], list[int]]:
    """(the prompt's token ids, the output a failed node already delivered); raises InvalidRequest
    for a field the node cannot serve."""
    if not request.request_id or len(request.request_id) > MAX_ID_LEN:
        raise InvalidRequest(f"request_id must be 1..{MAX_ID_LEN} characters")
    if not request.tenant:
        raise InvalidRequest("tenant is missing")
    ids = list(request.prompt_token_ids)
    if not ids:
        raise InvalidRequest("prompt_token_ids is empty")
    if request.num_resumed_tokens >= len(ids):
        raise InvalidRequest("num_resumed_tokens must be smaller than the number of prompt tokens")
    split = len(ids) - request.num_resumed_tokens
    return ids[:split], ids[split:]


def error_event(request_id: str, code: grpc.StatusCode, message: str, refusal: str = "") -> compute_pb2.RequestEvent:
    return compute_pb2.RequestEvent(request_id=request_id, error=compute_pb2.RequestError(
        code=code.value[0], message=message, refusal=refusal))


class RequestStream:
    """A started request's state on the node. ``emit`` hands its events to the stream; ``on_end``
    runs once, whichever way it ends."""

    def __init__(self, request: compute_pb2.ComputeRequest, node: NodeContext, emit: Emit,
                 on_end: Callable[["RequestStream"], None]):
        self.request = request
        self.request_id = request.request_id
        self.node = node
        self.emit = emit
        self.on_end = on_end
        self.ended = False
        self.completion_tokens = 0
        self._pending_ids: list[int] = []
        self._pending_text: list[str] = []
        self.span = tracer.start_span("generate", context=propagate.extract(dict(request.trace_context)),
                                      kind=trace.SpanKind.SERVER,
                                      attributes={"kvfleet.node_id": node.node_id,
                                                  "kvfleet.tenant": request.tenant,
                                                  "kvfleet.request_id": request.request_id})
        self.phase = tracer.start_span("prefill", context=trace.set_span_in_context(self.span))
        self._first = True
        self._usage_sent = False
        self.arrival_s = time.monotonic()  # the start of its queue time (request_phases.py)

    async def run(self) -> None:
        """Check, allocate early and hand the request to the engine; a problem ends it with an error,
        this node's own fault included (UNAVAILABLE: the router sends it elsewhere), so that no
        request is left waiting on a start that died."""
        try:
            await self._start()
        except Exception as e:
            log.error("node %s: starting request %s failed", self.node.node_id, self.request_id, exc_info=e)
            if not self.ended:
                self.node.abort(self.request_id)
                self.fail(grpc.StatusCode.UNAVAILABLE,
                          f"node {self.node.node_id} could not start the request ({type(e).__name__}: {e})")

    async def _start(self) -> None:
        if self.ended:  # cancelled before this task ran (its start and cancel came in one message):
            return      # its end released nothing, so nothing may be asked for it now
        request, node = self.request, self.node
        state = node.state
        if state != NodeState.READY:
            self.fail(grpc.StatusCode.UNAVAILABLE, f"node {node.node_id} is {state.value}, not taking requests")
            return
        try:
            prompt, resumed = check_request(request)
            sampling = sampling_from_proto(request.sampling)
            node.check_prompt(prompt, resumed)  # a prompt too long is refused before blocks are asked for
        except ValueError as e:  # InvalidRequest is one
            self.fail(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        self.span.set_attributes({"kvfleet.prompt_tokens": len(prompt), "kvfleet.resumed_tokens": len(resumed)})
        # block_service calls for this request join its trace, under the prefill span
        with trace.use_span(self.phase):
            known = prompt + resumed  # a hand-over's last token has no KV yet: it is fed next
            await node.fetch_prefix(request.tenant, known[:-1] if request.kv_source_node_id else known,
                                    request.kv_source_node_id, request.prefix_group)
            if self.ended:  # cancelled while its prefix came
                return
            await node.allocate_early(self.request_id, request.tenant, prompt + resumed,
                                      trace.set_span_in_context(self.phase), request.prefix_group)
        if self.ended:  # cancelled while allocating
            return
        try:
            await node.submit(self.request_id, prompt, resumed, sampling, self.on_output, request.tenant,
                              request.priority, self.arrival_s, request.prefix_group)
        except ValueError as e:
            self.fail(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def on_output(self, out: RequestOutput) -> None:
        """An engine output (on the event loop, a step's outputs together)."""
        if self.ended:
            return
        if out.refusal is not None:
            self.fail(grpc.StatusCode.RESOURCE_EXHAUSTED, out.error, out.refusal.reason)
            return
        if out.finish_reason == "error":  # a step raised: the engine's own error, the router may try elsewhere
            self.fail(grpc.StatusCode.INTERNAL, out.failure)
            return
        if out.failure is not None:  # the node's trouble, not the request's: the router fails it over
            self.fail(grpc.StatusCode.UNAVAILABLE, out.failure)
            return
        if not out.new_token_ids and not out.finished:  # a prefill chunk done, no token yet
            self.emit(compute_pb2.RequestEvent(request_id=self.request_id, chunk=compute_pb2.ComputeChunk()))
            return
        if self._first:
            self._first = False
            self.phase.set_attribute("kvfleet.cached_tokens", out.cached_tokens)
            self.phase.end()
            self.phase = tracer.start_span("decode", context=trace.set_span_in_context(self.span))
        self.completion_tokens = out.completion_tokens
        self._pending_ids += out.new_token_ids
        self._pending_text.append(out.new_text)
        if out.finished or len(self._pending_ids) >= self.node.stream_interval:
            chunk = compute_pb2.ComputeChunk(
                token_ids=self._pending_ids, text="".join(self._pending_text),
                finish_reason=FINISH.get(out.finish_reason, inference_pb2.FINISH_REASON_UNSPECIFIED))
            if out.finished or not self._usage_sent:  # the router takes cached_tokens from the first
                self._usage_sent = True
                chunk.usage.CopyFrom(inference_pb2.Usage(prompt_tokens=out.prompt_tokens,
                                                         completion_tokens=out.completion_tokens,
                                                         cached_tokens=out.cached_tokens))
            self._pending_ids, self._pending_text = [], []
            self.emit(compute_pb2.RequestEvent(request_id=self.request_id, chunk=chunk))
        if out.finished:
            self.end()

    def fail(self, code: grpc.StatusCode, message: str, refusal: str = "") -> None:
        if self.ended:
            return
        self.phase.set_status(trace.StatusCode.ERROR, message)
        self.emit(error_event(self.request_id, code, message, refusal))
        self.end()

    def cancel(self) -> None:
        """The router no longer wants it (or its stream is gone): abort it quietly."""
        if not self.ended:
            self.node.abort(self.request_id)
            self.end()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        self.node.release_early(self.request_id)
        self.phase.set_attribute("kvfleet.completion_tokens", self.completion_tokens)
        self.phase.end()
        self.span.set_attribute("kvfleet.completion_tokens", self.completion_tokens)
        self.span.end()
        self.on_end(self)

