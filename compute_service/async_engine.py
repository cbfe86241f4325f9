"""An asyncio face for ``LLMEngine``: the step loop runs in one background thread (the engine is
not thread-safe, so only that thread touches it); requests and aborts reach it through an inbox,
outputs come back to each request's asyncio queue."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable

from compute_service.engine import LLMEngine
from compute_service.request_output import RequestOutput
from compute_service.sampling import SamplingParams


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt: str | list[int], sampling: SamplingParams,
                       tenant: str = "default", priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; bad input raises ``ValueError``.
        Leaving the iteration early (or cancellation) aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        accepted = loop.create_future()

        def deliver(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, sampling, tenant, priority, on_output=deliver)
            except Exception as exc:  # handed to the caller's task, which re-raises it
                loop.call_soon_threadsafe(_settle, accepted, exc)
            else:
                loop.call_soon_threadsafe(_settle, accepted, None)

        self._submit(add)
        await accepted
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._submit(lambda: self.engine.abort_request(request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> "asyncio.Future":
        """Run ``fn(engine)`` on the engine thread (for stats and the like); await the result."""
        loop = asyncio.get_running_loop()
        result = loop.create_future()

        def run() -> None:
            try:
                value = fn(self.engine)
            except Exception as exc:
                loop.call_soon_threadsafe(_settle, result, exc)
            else:
                loop.call_soon_threadsafe(_settle, result, None, value)

        self._submit(run)
        return result

    def is_alive(self) -> bool:
        """False once the step loop has died (an exception in a step) or was shut down."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _submit(self, action: Callable[[], None]) -> None:
        self._inbox.put(action)
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopped:
            while True:
                try:
                    self._inbox.get_nowait()()
                except queue.Empty:
                    break
            if self.engine.has_unfinished_requests():
                self.engine.step()
            else:
                self._wake.wait()
                self._wake.clear()


def _settle(future: asyncio.Future, exc: BaseException | None, value: object = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
