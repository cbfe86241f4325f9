"""Chaos clients: grpc.aio callers of the public API (``kvfleet.v1.Inference/Generate`` with
``authorization: Bearer``) that turn every request into an ``Outcome``, whatever happens to it.

    send(stub, spec, prompts)      one request, cancelled by the client when its spec says so
    send_raw(channel, payload)     undecodable bytes through identity serializers
    LoadGenerator                  a few client tasks sending a mix of specs until stopped
    PromptBook                     seeded prompts by name, with their greedy references
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from chaos_outcomes import CANCELLED, OK, Outcome, RequestSpec

from kvfleet.v1 import inference_pb2

GENERATE = "/kvfleet.v1.Inference/Generate"
FINISH_NAMES = {inference_pb2.FINISH_REASON_STOP: "STOP", inference_pb2.FINISH_REASON_LENGTH: "LENGTH",
                inference_pb2.FINISH_REASON_ABORT: "ABORT"}
CALL_TIMEOUT_S = 120.0  # a hung stream ends as DEADLINE_EXCEEDED: undocumented, so reported
ERROR_PAUSE_S = 0.1


@dataclass(slots=True)
class PromptBook:
    """Named prompts (token ids) and, once recorded, each one's greedy tokens before any fault."""

    prompts: dict[str, list[int]]
    references: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def seeded(cls, lengths: dict[str, int], seed: int = 0) -> PromptBook:
        rng = random.Random(seed)
        return cls({name: [rng.randrange(256) for _ in range(n)] for name, n in lengths.items()})

    async def record_references(self, stub, api_key: str, max_tokens: Mapping[str, int]) -> None:
        """One greedy run per prompt, sequentially on the healthy cluster: what every later run of
        the same prompt must reproduce (its first ``max_tokens[name]`` tokens)."""
        for name in self.prompts:
            spec = RequestSpec("reference", api_key, name, max_tokens[name])
            outcome = await send(stub, spec, self)
            if outcome.code != OK or len(outcome.tokens) != spec.max_tokens:
                raise RuntimeError(f"reference run of {name!r} failed: {outcome.code} {outcome.details} "
                                   f"after {len(outcome.tokens)} tokens")
            self.references[name] = outcome.tokens


def build_request(spec: RequestSpec, book: PromptBook) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True))
    req.tokens.ids.extend(book.prompts[spec.prompt])
    return req


def bearer(api_key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {api_key}")]


HUNG = "HUNG"  # not a status: the request had no end when the load stopped waiting for it


async def send(stub, spec: RequestSpec, book: PromptBook | None = None,
               request: inference_pb2.GenerateRequest | None = None,
               metadata: Sequence[tuple[str, str]] | None = None, outcome: Outcome | None = None) -> Outcome:
    """Run one request to its end: finished, refused, broken or cancelled by this client.
    ``request``/``metadata`` replace what ``spec`` would build (fuzzed requests). ``outcome``, when
    given, is filled in place, so a caller that gives up on the request still has what came."""
    request = request if request is not None else build_request(spec, book)
    metadata = metadata if metadata is not None else bearer(spec.api_key)
    if outcome is None:
        outcome = Outcome(spec, HUNG, [], sent_at=time.monotonic())
    call = stub.Generate(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
    timer = None
    if spec.cancel_after_s is not None:
        timer = asyncio.get_running_loop().call_later(spec.cancel_after_s, call.cancel)
    try:
        async for chunk in call:
            outcome.tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                outcome.finish = FINISH_NAMES.get(chunk.finish_reason, str(chunk.finish_reason))
            if spec.cancel_after_tokens is not None and len(outcome.tokens) >= spec.cancel_after_tokens \
                    and not outcome.finish:
                call.cancel()
        outcome.code = OK
    except asyncio.CancelledError:
        if not call.cancelled() or asyncio.current_task().cancelling():
            call.cancel()
            outcome.details = "still running when the client gave up on it"
            raise  # not this client's cancel: the task itself is being stopped
        outcome.code, outcome.cancelled = CANCELLED, True
    except grpc.aio.AioRpcError as err:
        outcome.code, outcome.details = err.code().name, err.details() or ""
        outcome.cancelled = err.code() == grpc.StatusCode.CANCELLED and call.cancelled()
    finally:
        if timer is not None:
            timer.cancel()
        outcome.ended_at = time.monotonic()
    return outcome


async def send_raw(channel: grpc.aio.Channel, payload: bytes, spec: RequestSpec) -> Outcome:
    """``payload`` as the request message, unparsed on our side (identity serializers): what a
    broken or hostile client sends."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)(
        payload, metadata=bearer(spec.api_key), timeout=CALL_TIMEOUT_S)
    outcome = Outcome(spec, OK, [], sent_at=time.monotonic())
    try:
        async for raw in call:
            outcome.tokens.extend(inference_pb2.GenerateChunk.FromString(raw).token_ids)
    except grpc.aio.AioRpcError as err:
        outcome.code, outcome.details = err.code().name, err.details() or ""
    outcome.ended_at = time.monotonic()
    return outcome


class LoadGenerator:
    """``clients`` tasks, each sending one request after another, drawn from ``mix`` by a seeded
    random choice, until ``stop()``; every request's outcome is kept.

        async with LoadGenerator(stub, book, mix) as load:
            ... the fault ...
        load.outcomes
    """

    def __init__(self, stub, book: PromptBook, mix: Sequence[RequestSpec], clients: int = 4, seed: int = 0,
                 pause_s: float = 0.0, limit: int | None = None):
        self.limit = limit  # requests in all, when given: then the clients stop by themselves
        self.stub = stub
        self.book = book
        self.mix = list(mix)
        self.clients = clients
        self.pause_s = pause_s
        self.rng = random.Random(seed)
        self.outcomes: list[Outcome] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self) -> None:
        while not self._stopping.is_set() and (self.limit is None or len(self.outcomes) < self.limit):
            outcome = Outcome(self.rng.choice(self.mix), HUNG, [], sent_at=time.monotonic())
            self.outcomes.append(outcome)
            await send(self.stub, outcome.spec, self.book, outcome=outcome)
            # after an error, a breath: a client of a dead door would otherwise spin
            pause = self.pause_s if outcome.code in (OK, CANCELLED) else max(self.pause_s, ERROR_PAUSE_S)
            if pause:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), pause)

    def start(self) -> LoadGenerator:
        self._tasks = [asyncio.create_task(self._client(), name=f"chaos-client-{i}") for i in range(self.clients)]
        return self

    async def wait_for(self, count: int, timeout_s: float = 60.0) -> None:
        """Until ``count`` requests have ended in all (the load flows), or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.num_ended() < count and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def num_ended(self) -> int:
        return sum(o.code != HUNG for o in self.outcomes)

    async def finish(self, timeout_s: float = 120.0) -> list[Outcome]:
        """All ``limit`` requests ended (or ``timeout_s``): their outcomes."""
        await asyncio.wait(self._tasks, timeout=timeout_s)
        return await self.stop()

    async def stop(self, timeout_s: float = 30.0) -> list[Outcome]:
        """Let the requests in flight end (each client finishes its current one) for up to
        ``timeout_s``; a request still running then is cancelled and stays ``HUNG``."""
        self._stopping.set()
        _, pending = await asyncio.wait(self._tasks, timeout=timeout_s)
        for task in pending:
            task.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        return self.outcomes

    async def __aenter__(self) -> LoadGenerator:
        return self.start()

    async def __aexit__(self, *exc) -> None:
        if exc[0] is None:
            await self.stop()
        else:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
