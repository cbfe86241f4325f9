"""An asyncio face for ``LLMEngine``: the step loop runs in one background thread (the engine is
not thread-safe, so only that thread touches it); requests and aborts reach it through an inbox,
each step's outputs come back to the event loop in one wake-up, to each request's callback.

A step that raises fails its own requests (``LLMEngine.step``) and the loop goes on. A step that
scheduled nothing (every sequence waits for blocks block_service cannot grant now) is followed by a
short wait, so a node whose block_service is down does not spin a core asking."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from kvfleet.compute_service.engine.llm_engine import LLMEngine
from kvfleet.compute_service.engine.request_output import RequestOutput
from kvfleet.core.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_BURST_WAITS = 10  # an idle engine holds its first step at most this many batch waits
STALL_WAIT_S = 0.05   # after a step that scheduled nothing, before asking for blocks again


class AsyncEngine:
    def __init__(self, engine: LLMEngine, batch_wait_s: float = 0.0,
                 after_step: Callable[[list[RequestOutput]], None] | None = None):
        """``after_step`` sees every step's outputs on the step thread (the P99 controller)."""
        if batch_wait_s < 0:
            raise ValueError(f"batch_wait_s must be >= 0, got {batch_wait_s}")
        self.engine = engine
        self.batch_wait_s = batch_wait_s
        self.after_step = after_step
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        # outputs of the current step, handed to their event loops in one wake-up per step
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[[RequestOutput], None], RequestOutput]] = []
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="engine-step-loop", daemon=True)
        self._thread.start()

    async def submit(self, request_id: str, prompt: str | list[int], sampling: SamplingParams,
                     on_output: Callable[[RequestOutput], None], tenant: str = "default",
                     priority: int = 0, generated: list[int] | tuple[int, ...] = (),
                     arrival_s: float | None = None, prefix_group: str = "") -> None:
        """Add a request; returns once the engine accepted it (bad input raises ``ValueError``).
        ``on_output`` runs on the calling event loop, the outputs of one step in one callback round,
        possibly before this coroutine has returned. ``generated``: output already delivered by a
        node that failed (see ``LLMEngine.add_request``); ``arrival_s``: when it reached the node
        (``time.monotonic``; default now); ``prefix_group``: the group salting its chain."""
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        arrival_s = time.monotonic() if arrival_s is None else arrival_s

        def deliver(out: RequestOutput) -> None:  # on the engine thread; sent once per step
            self._outbox.append((loop, on_output, out))

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt, sampling, tenant, priority, deliver, generated, arrival_s,
                                        prefix_group)
            except Exception as exc:  # handed to the caller's task, which re-raises it
                loop.call_soon_threadsafe(_settle, accepted, exc)
            else:
                loop.call_soon_threadsafe(_settle, accepted, None)

        self._submit(add)
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been added all the same
            raise

    def check_prompt(self, ids: list[int], generated: list[int]) -> None:
        """``LLMEngine.check_prompt`` (safe off the engine thread: it reads only fixed settings)."""
        self.engine.check_prompt(ids, generated)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks (a no-op once it finished)."""
        self._submit(lambda: self.engine.abort_request(request_id))

    async def generate(self, request_id: str, prompt: str | list[int], sampling: SamplingParams,
                       tenant: str = "default", priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine produces them; bad input raises ``ValueError``.
        Leaving the iteration early (or cancellation) aborts the request."""
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        await self.submit(request_id, prompt, sampling, outputs.put_nowait, tenant, priority)
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def fail(self, request_id: str, reason: str) -> None:
        """End a request with a failure (``RequestOutput.failure``): its router moves it to
        another node. A no-op once it finished."""
        self._submit(lambda: self.engine.fail_request(request_id, reason))

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

    def _flush_outbox(self) -> None:
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, on_output, out in self._outbox:
            by_loop.setdefault(loop, []).append((on_output, out))
        self._outbox = []
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_deliver_all, items)

    def _gather_burst(self) -> None:
        """Idle → busy: let a burst of arrivals land before the first step, so it runs as one batch
        instead of a step for the first few while the rest wait a whole step. Waits while they keep
        coming less than ``batch_wait_s`` apart, at most ``MAX_BURST_WAITS`` times that in all."""
        if self.batch_wait_s <= 0:
            return
        deadline = time.monotonic() + MAX_BURST_WAITS * self.batch_wait_s
        while (left := deadline - time.monotonic()) > 0 and self._wake.wait(min(self.batch_wait_s, left)):
            self._wake.clear()

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
                outputs = self.engine.step()
                if self.after_step is not None:
                    self.after_step(outputs)
            self._flush_outbox()
            if self.engine.stalled and self.engine.has_unfinished_requests():
                self._wake.wait(STALL_WAIT_S)  # an arrival or an abort cuts it short
                self._wake.clear()
            elif not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                self._gather_burst()


def _deliver_all(items: list[tuple[Callable[[RequestOutput], None], RequestOutput]]) -> None:
    for on_output, out in items:
        try:
            on_output(out)
        except Exception:  # one request's consumer failing must not starve the others
            log.exception("output callback of request %s failed", out.request_id)


def _settle(future: asyncio.Future, exc: BaseException | None, value: object = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
