"""The event loop every kvfleet service runs on: uvloop where it is installed, else asyncio's own.

uvloop (libuv) does the loop's bookkeeping in C: each streamed token costs the router, the compute
node and a client fewer microseconds, which on a small machine are taken from the model.
``KVFLEET_EVENT_LOOP=asyncio`` forces the standard loop (to compare, or to rule uvloop out).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_kind() -> str:
    """``"uvloop"`` or ``"asyncio"``: what ``run`` will use."""
    if os.environ.get("KVFLEET_EVENT_LOOP", "").lower() == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    if loop_kind() == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
