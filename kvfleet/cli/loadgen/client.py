"""One request through the public API (``kvfleet.v1.Inference/Generate``), timed as it streams,
and a closed loop of clients that keeps a given number of requests in flight.

The request is the one a user sends: token ids as the prompt, greedy, ``ignore_eos`` so that every
request generates exactly ``max_tokens`` (a fixed amount of work per request, comparable across
runs), the API key as ``authorization: Bearer`` metadata (``generate_client.bearer``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from kvfleet.cli.generate_client import bearer, finish_name, no_router_line
from kvfleet.cli.loadgen.records import RequestRecord
from kvfleet.cli.loadgen.workload import Shape, Workload
from kvfleet.core import rpc
from kvfleet.v1 import inference_pb2, inference_pb2_grpc

PROBE_TIMEOUT_S = 5.0


class RouterProblem(Exception):
    """The router cannot be used: down, or the key is refused (one line for the user)."""


def request(shape: Shape) -> inference_pb2.GenerateRequest:
    req = inference_pb2.GenerateRequest(sampling=inference_pb2.SamplingParams(
        max_tokens=shape.max_tokens, temperature=0.0, ignore_eos=True))
    req.tokens.ids.extend(shape.prompt)
    return req


class Client:
    """A channel to the router and the tenant's key; ``probe()`` before any load."""

    def __init__(self, router: str, api_key: str, timeout_s: float, clock: Callable[[], float]):
        self.router = router
        self.metadata = bearer(api_key)
        self.timeout_s = timeout_s
        self.clock = clock  # seconds since the bench started
        self._channel = rpc.channel(router)
        self.stub = inference_pb2_grpc.InferenceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def probe(self) -> None:
        """Raise ``RouterProblem`` when nobody answers at the address or the key is refused.

        A request without a prompt: the router authenticates before it validates, so a good key
        gets INVALID_ARGUMENT (and nothing runs, nothing is counted) and a bad one UNAUTHENTICATED."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), PROBE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RouterProblem(no_router_line("bench", self.router)) from None
        try:
            async for _ in self.stub.Generate(inference_pb2.GenerateRequest(), metadata=self.metadata,
                                              timeout=PROBE_TIMEOUT_S):
                pass
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise RouterProblem(f"kvfleet bench: the router at {self.router} refuses the API key "
                                    f"({err.details()})") from None
            if err.code() == grpc.StatusCode.UNAVAILABLE:
                raise RouterProblem(f"kvfleet bench: the router at {self.router} is unavailable "
                                    f"({err.details()})") from None

    async def send(self, shape: Shape, record: RequestRecord) -> RequestRecord:
        """Run one request to its end, filling ``record`` in place (the caller may watch it)."""
        call = self.stub.Generate(request(shape), metadata=self.metadata, timeout=self.timeout_s)
        last = None
        try:
            async for chunk in call:
                now = self.clock()
                n = len(chunk.token_ids)
                if n:
                    if last is None:
                        record.ttft_s = now - record.sent_at
                    else:
                        record.itl_s.extend([(now - last) / n] * n)
                    last = now
                    record.completion_tokens += n
                if chunk.finish_reason:
                    record.finish = finish_name(chunk.finish_reason)
                    record.usage_prompt_tokens = chunk.usage.prompt_tokens
                    record.usage_completion_tokens = chunk.usage.completion_tokens
        except grpc.aio.AioRpcError as err:
            record.status = err.code().name
        finally:
            record.ended_at = self.clock()
        return record


async def closed_loop(client: Client, workload: Workload, phase: str, concurrency: int,
                      count: int | None = None, until: float | None = None,
                      on_done: Callable[[RequestRecord], None] = lambda r: None) -> list[RequestRecord]:
    """``concurrency`` clients, each sending its next request when the previous one ends, until
    ``count`` requests have been sent or the clock passes ``until`` (requests in flight then are
    let finish). Returns every request's record, in the order they were sent."""
    assert count is not None or until is not None
    records: list[RequestRecord] = []

    def more() -> bool:
        return (count is None or len(records) < count) and (until is None or client.clock() < until)

    async def one_client() -> None:
        while more():
            shape = workload.next()
            record = RequestRecord(phase, concurrency, shape.prompt_tokens, shape.max_tokens, client.clock())
            records.append(record)
            on_done(await client.send(shape, record))

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return records


def monotonic_since(start: float | None = None) -> Callable[[], float]:
    """A clock in seconds from now (or from ``start``, a ``time.monotonic()`` reading)."""
    t0 = time.monotonic() if start is None else start
    return lambda: time.monotonic() - t0
