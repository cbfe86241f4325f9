"""The OpenAI-compatible HTTP door: FastAPI served by uvicorn inside the router's own event loop.

    GET  /health                 200 while a compute node is READY, else 503
    GET  /v1/models              the served model
    POST /v1/completions         prompt text or token ids      (stream: server-sent events)
    POST /v1/chat/completions    messages, rendered by the model's chat template

Glue only: authenticate the ``Authorization: Bearer`` header with the tenants of the gRPC door,
check the body (``kvfleet.router.openai_requests``), build the public ``GenerateRequest``, run it on the
one path both doors share (``kvfleet.router.generation``: queue, routing, failover, traces), shape the
answer (``kvfleet.router.openai_responses``). Every failure becomes OpenAI's error shape with its HTTP
status from ``HTTP_STATUS``, in one place. A client that disconnects cancels its request: the
node stops it and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import trace
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from kvfleet.core.wire import sampling_to_proto
from kvfleet.router.generation import Generations, status_name
from kvfleet.router.nodes import NodeTable
from kvfleet.router.openai_requests import ApiError, OpenAICall, parse_call
from kvfleet.router.openai_responses import DONE, FINISH_REASONS, Answer, Usage, sse
from kvfleet.router.pinning import set_cache
from kvfleet.router.server import CannotListen
from kvfleet.v1 import inference_pb2

log = logging.getLogger(__name__)
tracer = trace.get_tracer(__name__)

# gRPC status name → (HTTP status, OpenAI error type)
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),  # e.g. kvfleet_pin without a pin budget
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
    "INTERNAL": (500, "server_error"),                     # an engine step raised: its one-line summary
}


def api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, TimeoutError):
        return ApiError(504, "the request took longer than the router's --http-timeout-s", type="timeout_error")
    name = status_name(e) if isinstance(e, Exception) else None
    if name is None:
        log.exception("HTTP door: unexpected error", exc_info=e)
        return ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
    status, kind = HTTP_STATUS.get(name, (500, "server_error"))
    return ApiError(status, str(e), type=kind, code=name.lower())


def error_response(e: BaseException) -> JSONResponse:
    err = api_error(e)
    return JSONResponse(err.body(), status_code=err.status)


def generate_request(call: OpenAICall) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest()
    sampling_to_proto(call.sampling, req.sampling)
    if call.messages:
        req.chat.messages.extend(inference_pb2.ChatMessage(role=m.role, content=m.content) for m in call.messages)
    elif call.token_ids is not None:
        req.tokens.ids.extend(call.token_ids)
    else:
        req.text = call.text
    set_cache(req, call.pin)
    return req


async def read_json(request: Request):
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(400, f"Content-Type must be application/json, got {media_type or 'none'!r}")
    try:
        raw = await request.body()
    except ClientDisconnect:  # the client left while sending its body: nobody to answer
        raise ClientGone() from None
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def finish_reason(chunk) -> str:
    return FINISH_REASONS.get(inference_pb2.FinishReason.Name(chunk.finish_reason), "stop")


def usage_of(chunk) -> Usage:
    return Usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens, chunk.usage.cached_tokens,
                 chunk.usage.pinned_tokens or None)  # (kvfleet_pinned_tokens: only when a pin was made)


class Door:
    """The endpoints, over the router's ``Generations`` and node table."""

    def __init__(self, generations: Generations, nodes: NodeTable, timeout_s: float):
        self.generations = generations
        self.nodes = nodes
        self.timeout_s = timeout_s

    def app(self) -> FastAPI:
        app = FastAPI(title="kvfleet", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        app.add_api_route("/v1/completions", self.completions, methods=["POST"])
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        return app

    async def health(self) -> JSONResponse:
        if self.nodes.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "no READY compute node"}, status_code=503)

    async def _model_name(self) -> str:
        return (await self.generations.tokenizers.get()).name

    def _tenant(self, request: Request):
        return self.generations.tenants.authenticate_metadata(
            ("authorization", v) for v in request.headers.getlist("authorization"))

    async def models(self, request: Request) -> JSONResponse:
        try:
            self._tenant(request)
            name = await self._model_name()
        except Exception as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                                         "owned_by": "kvfleet"}]})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, kind: str) -> Response:
        # under the HTTP server span when FastAPI traces (it does when a tracer provider is set)
        span = tracer.start_span(f"openai {kind}")
        stack = contextlib.AsyncExitStack()
        stack.callback(span.end)
        try:
            tenant = self._tenant(request)
            call = parse_call(await read_json(request), kind)
            name = await self._model_name()
            if call.model != name:
                raise ApiError(404, f"The model {call.model!r} does not exist; this router serves {name!r}",
                               param="model", code="model_not_found")
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            chunks, first = await _unless_gone(request, self._open(tenant, call, stack, span, deadline))
            answer = Answer(kind, first.request_id, name, call.include_usage)
            if call.stream:  # the background closes the stack too if the stream never started
                return StreamingResponse(self._events(answer, first, chunks, stack, span, deadline),
                                         media_type="text/event-stream", background=BackgroundTask(_close, stack))
            body = await _unless_gone(request, self._whole(answer, first, chunks, span, deadline))
            await stack.aclose()
            return JSONResponse(body)
        except ClientGone:  # nobody reads an answer
            await stack.aclose()
            return Response(status_code=499)
        except BaseException as e:
            span.set_status(trace.StatusCode.ERROR, str(e))
            await stack.aclose()
            if not isinstance(e, Exception):
                raise
            return error_response(e)

    async def _open(self, tenant, call: OpenAICall, stack, span, deadline):
        """Wait for the request's turn and its first chunk: (the chunks, the first)."""
        with trace.use_span(span, end_on_exit=False):
            async with asyncio.timeout_at(deadline):
                chunks = await stack.enter_async_context(self.generations.generation(
                    tenant, generate_request(call), call.conversation))
                return chunks, await anext(chunks)

    @staticmethod
    async def _whole(answer: Answer, chunk, chunks, span, deadline) -> dict:
        """The rest of the chunks, as one answer (``stream: false``)."""
        text = [chunk.text]
        with trace.use_span(span, end_on_exit=False):
            async with asyncio.timeout_at(deadline):
                async for chunk in chunks:
                    text.append(chunk.text)
        return answer.complete("".join(text), finish_reason(chunk), usage_of(chunk))

    async def _events(self, answer: Answer, chunk, chunks, stack, span, deadline):
        """Server-sent events; the stack (the request's turn and its node) is closed when the
        stream ends, fails, or the client leaves (Starlette cancels this generator)."""
        try:
            with trace.use_span(span, end_on_exit=False):
                while True:
                    done = chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED
                    if chunk.text or done:
                        yield sse(answer.delta(chunk.text, finish_reason(chunk) if done else None))
                    if done:
                        if answer.include_usage:
                            yield sse(answer.usage_chunk(usage_of(chunk)))
                        yield DONE
                        return
                    try:
                        async with asyncio.timeout_at(deadline):
                            chunk = await anext(chunks)
                    except Exception as e:  # StopAsyncIteration too: a relay that ended without a finish
                        yield sse(api_error(e).body())
                        return
        finally:
            await _close(stack)


async def _close(stack: contextlib.AsyncExitStack) -> None:
    """Release the request (its turn, its id, its node's work) even while being cancelled."""
    with anyio.CancelScope(shield=True):
        await stack.aclose()


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _unless_gone(request: Request, work):
    """Await ``work``; if the client disconnects first, cancel it (its request leaves the queue,
    or its node stops it) and raise ``ClientGone``. Streaming needs no watch: Starlette cancels
    a stream whose client left."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The router's loop owns SIGTERM and SIGINT (it stops both doors in order)."""
        yield


def bind(listen: str) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: any); refuses with one line when taken."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        return socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    reuse_port=False)
    except (OSError, ValueError) as e:
        raise CannotListen(f"cannot listen on {listen} for HTTP: {e}") from None


class HttpServer:
    """uvicorn on a socket bound up front, run as a task of the calling event loop."""

    def __init__(self, door: Door, listen: str, tls_cert: str | None = None, tls_key: str | None = None):
        self.socket = bind(listen)
        self.port = self.socket.getsockname()[1]
        self.scheme = "https" if tls_cert else "http"
        config = uvicorn.Config(door.app(), lifespan="off", log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, ssl_certfile=tls_cert, ssl_keyfile=tls_key)
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.socket]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.socket.close()
