"""Awaiting a gRPC call from a task that may be cancelled, without cancelling the call. Pure asyncio.

grpc.aio frees a batch's native memory (its ``grpc_op`` array, the message buffers, the status
slices) only when the task that awaits the batch sees it complete. A task cancelled while a batch
is in flight drops it with that memory still allocated: about 0.9 KiB per unary call (grpc/grpc
issue 43360, open in grpcio 1.85). The router's request task is cancelled whenever its client
leaves, and that task awaits block_service's prefix lookup; each client that left during a lookup
cost the router that much for good (issue 35: its resident memory grew with the cancellations).

``run_to_end(coro)`` awaits ``coro`` in a task of its own behind ``asyncio.shield``: a caller
cancelled meanwhile gets ``CancelledError`` at once, as before, and the call runs to its end in the
background (bounded by its deadline), its answer dropped. Shielding the call object itself is not
enough: its awaiter must be a task nobody cancels.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_running: set[asyncio.Task] = set()  # strong references: a task only the loop knows may be collected


async def run_to_end(coro: Coroutine[Any, Any, T]) -> T:
    """``coro``'s result; if the caller is cancelled first, ``coro`` still runs to its end."""
    task = asyncio.ensure_future(coro)
    _running.add(task)
    task.add_done_callback(_finished)
    return await asyncio.shield(task)


def running() -> int:
    """Calls whose caller left and that have not ended yet (and those still awaited)."""
    return len(_running)


def _finished(task: asyncio.Task) -> None:
    _running.discard(task)
    if not task.cancelled():
        task.exception()  # retrieved: an answer nobody waits for any more may be an error
