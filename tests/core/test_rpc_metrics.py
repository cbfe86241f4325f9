"""Calls are counted by method; a path outside the service counts as ``other`` (bounded labels)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter

from kvfleet.core.rpc_metrics import CallCounter


def test_calls_are_counted_by_method_and_unknown_paths_as_other():
    registry = CollectorRegistry()
    counter = CallCounter(Counter("calls", "calls", ["operation"], registry=registry), {"ApplyMany", "Stats"})

    async def continuation(details):
        return f"handler of {details.method}"

    async def main():
        for method in ["/kvfleet.v1.BlockManager/ApplyMany"] * 3 + ["/kvfleet.v1.BlockManager/Stats", "/x.Y/Z", "/junk"]:
            assert await counter.intercept_service(continuation, SimpleNamespace(method=method)) \
                == f"handler of {method}"

    asyncio.run(main())
    assert registry.get_sample_value("calls_total", {"operation": "ApplyMany"}) == 3
    assert registry.get_sample_value("calls_total", {"operation": "Stats"}) == 1
    assert registry.get_sample_value("calls_total", {"operation": "other"}) == 2
