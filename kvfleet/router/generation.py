"""One path from a parsed request to its stream of chunks, for both doors (gRPC and HTTP).

    authenticate (the door's) → parse + tokenize → claim the request id → queue → relay → release

A door authenticates in its own way (gRPC metadata, an HTTP header), then opens a ``generation``
and reads its chunks. Every refusal is an exception: those before the first chunk carry their gRPC
status name in ``REFUSALS``, a ``RelayError`` carries its own; each door maps the status name to
its answer in one table.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from opentelemetry import trace

from kvfleet.core.tenants import Tenant
from kvfleet.router.admission import Admission, Shed
from kvfleet.router.canary_split import conversation_key
from kvfleet.router.canary_watch import CanaryRouting
from kvfleet.router.metrics import RequestMetrics, RequestTimer
from kvfleet.router.model_text import NoTokenizer, TokenizerSource
from kvfleet.router.relay import Relay, RelayError
from kvfleet.router.request import InvalidRequest, ParsedRequest, parse_request
from kvfleet.router.running_ids import AlreadyRunning, RunningIds
from kvfleet.router.tenants import AuthError, TenantDirectory
from kvfleet.v1 import inference_pb2

tracer = trace.get_tracer(__name__)

REFUSALS: dict[type[Exception], str] = {  # exception → gRPC status name
    AuthError: "UNAUTHENTICATED",
    InvalidRequest: "INVALID_ARGUMENT",
    Shed: "RESOURCE_EXHAUSTED",
    AlreadyRunning: "ALREADY_EXISTS",
    NoTokenizer: "UNAVAILABLE",
}


def status_name(e: Exception) -> str | None:
    """The gRPC status name of a refusal or a relay error; None for anything else."""
    if isinstance(e, RelayError):
        return e.code.name
    return next((name for kind, name in REFUSALS.items() if isinstance(e, kind)), None)


class Generations:
    """The router's requests in flight: who runs which request id, and whose turn it is."""

    def __init__(self, tenants: TenantDirectory, admission: Admission, relay: Relay, tokenizers: TokenizerSource,
                 metrics: RequestMetrics | None = None, canary: CanaryRouting | None = None):
        self.tenants = tenants
        self.admission = admission
        self.relay = relay
        self.tokenizers = tokenizers
        self.metrics = metrics
        self.canary = canary
        self.running = RunningIds()

    @contextlib.asynccontextmanager
    async def generation(self, tenant: Tenant, request, conversation: str = "") -> AsyncIterator[AsyncIterator]:
        """The chunks of ``request`` (a ``kvfleet.v1.GenerateRequest``) once it has its turn.
        Leaving the block early (the client left) cancels it on its node and frees its turn.
        ``conversation``: the client's conversation id (OpenAI ``prompt_cache_key`` or ``user``), which
        keeps a conversation in one group of a canary split (``kvfleet/router/canary_split.py``)."""
        timer = self.metrics.request(tenant.name, time.monotonic()) if self.metrics is not None else None
        parsed = await self._admit(tenant, request, timer)
        try:
            group = None
            if self.canary is not None:
                chat = [(m.role, m.content) for m in request.chat.messages] if request.HasField("chat") else ()
                group = self.canary.group_for(tenant.name, conversation_key(conversation, chat, parsed.prompt_ids))
            relayed = self.relay.run(parsed, tenant, group) if timer is None else self._timed(parsed, tenant, timer,
                                                                                              group)
            if group is not None:
                relayed = self._observed(relayed, group)
            async with contextlib.aclosing(relayed) as chunks:
                yield chunks
        finally:
            self.admission.finish(tenant.name)
            self.running.release(tenant.name, parsed.request_id)

    async def parse(self, request) -> ParsedRequest:
        model = await self.tokenizers.get()
        return parse_request(request, model.tokenizer, model.chat, model.end_of_turn)

    async def _observed(self, chunks: AsyncIterator, group: str) -> AsyncIterator:
        """``chunks``, each seen by the canary's outcome timer of ``group``; the outcome recorded at the
        end, an error with its status name (a client that left records nothing: not the group's doing)."""
        timer = self.canary.timer(group)
        error, finished = "", False
        try:
            async with contextlib.aclosing(chunks) as inner:
                async for chunk in inner:
                    usage = chunk.usage
                    last = chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
                    timer.chunk(len(chunk.token_ids), (usage.prompt_tokens, usage.cached_tokens,
                                                       usage.completion_tokens) if last else None)
                    finished = finished or last
                    yield chunk
        except Exception as e:
            error = status_name(e) or type(e).__name__
            raise
        except BaseException:  # cancelled, or the consumer closed the stream: the client left (unless done)
            error = "" if finished else "CANCELLED"
            raise
        finally:
            if error != "CANCELLED":
                self.canary.record(timer.done(error))

    async def _timed(self, parsed: ParsedRequest, tenant: Tenant, timer: RequestTimer,
                     group: str | None = None) -> AsyncIterator:
        """The relay's chunks, each seen by ``timer`` (latencies, and the usage of the last)."""
        async with contextlib.aclosing(self.relay.run(parsed, tenant, group)) as chunks:
            async for chunk in chunks:
                now = time.monotonic()
                timer.tokens(len(chunk.token_ids), now)
                if chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    reason = inference_pb2.FinishReason.Name(chunk.finish_reason)
                    timer.finished(chunk.usage.prompt_tokens, chunk.usage.completion_tokens,
                                   chunk.usage.cached_tokens, reason.removeprefix("FINISH_REASON_").lower(), now)
                yield chunk

    async def _admit(self, tenant: Tenant, request, timer: RequestTimer | None = None) -> ParsedRequest:
        """The request checked, its id marked running, and its turn; ``generation`` releases both."""
        span = trace.get_current_span()
        span.set_attribute("kvfleet.tenant", tenant.name)
        parsed = await self.parse(request)
        span.set_attribute("kvfleet.request_id", parsed.request_id)
        self.running.claim(tenant.name, parsed.request_id)
        try:
            with tracer.start_as_current_span("queue", attributes={"kvfleet.tenant": tenant.name}):
                queued = time.monotonic()
                await self.admission.wait(parsed.seq_id, tenant.name, self.tenants.normalised_paid_level(tenant))
                if timer is not None:
                    timer.queued(tenant.paid_level, time.monotonic() - queued)
        except BaseException:  # shed, or the caller left while it waited
            self.running.release(tenant.name, parsed.request_id)
            raise
        return parsed
