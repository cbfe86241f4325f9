"""SIGTERM ends a node at any point of its start, not only once it is READY (a node whose warm-up
waited on an unreachable block_service was seen ignoring SIGTERM for an hour, orphaned by a killed
test). The start is replaced by one that never finishes, as a peer that never answers makes it."""

from __future__ import annotations

import asyncio
import os
import signal

from kvfleet.compute_service.node import lifecycle as node_lifecycle
from kvfleet.compute_service.node.settings import NodeCommand


def test_sigterm_while_the_start_waits_forever_stops_the_node(monkeypatch, caplog):
    started = asyncio.Event()

    async def start_that_waits(command, parts):
        started.set()
        await asyncio.Event().wait()  # a peer that never answers

    monkeypatch.setattr(node_lifecycle, "_start", start_that_waits)

    async def main():
        serving = asyncio.create_task(node_lifecycle.serve(NodeCommand(model="unused", node_id="n1")))
        await started.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 30)  # raises TimeoutError when SIGTERM is not obeyed

    caplog.set_level("INFO")
    asyncio.run(main())
    assert "node n1 stopped before it was READY" in caplog.text
