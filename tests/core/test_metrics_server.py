"""Scrapes answer from their own thread and read the service's figures on the service's loop."""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from kvfleet.core.metric_families import gauge
from kvfleet.core.metrics_server import LoopCollector, read_on_loop, serve_metrics


def test_a_scrape_reads_on_the_loop_thread_while_the_loop_keeps_running():
    async def main():
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()
        reads: list[int] = []

        async def read():
            reads.append(threading.get_ident())
            return len(reads)

        registry = CollectorRegistry()
        registry.register(LoopCollector(loop, read, lambda n: [gauge("scrapes", "reads so far", (), [((), n)])]))
        endpoint = serve_metrics(registry, "127.0.0.1:0", "test")
        try:
            for expected in (1, 2):  # the loop awaits the scrape in a thread: it is free to answer the read
                text = await asyncio.to_thread(lambda: urllib.request.urlopen(endpoint.url, timeout=10).read().decode())
                assert f"kvfleet:scrapes {float(expected)}" in text
        finally:
            endpoint.close()
        assert reads == [loop_thread, loop_thread]

    asyncio.run(main())


def test_a_loop_that_does_not_answer_costs_the_scrape_its_figures_not_the_loop():
    loop = asyncio.new_event_loop()  # never run: nothing on it ever answers
    try:
        async def read():
            return 1

        with pytest.raises(TimeoutError, match="did not answer a scrape"):
            read_on_loop(loop, read, timeout_s=0.01)
        collector = LoopCollector(loop, read, lambda n: [gauge("x", "x", (), [((), n)])], timeout_s=0.01)
        assert list(collector.collect()) == []
        loop.run_until_complete(asyncio.sleep(0.01))  # the reads, cancelled, are dropped without a warning
    finally:
        loop.close()


def test_a_read_that_fails_yields_no_families():
    async def main():
        loop = asyncio.get_running_loop()

        async def read():
            raise RuntimeError("stats unavailable")

        collector = LoopCollector(loop, read, lambda n: [gauge("x", "x", (), [((), n)])])
        return await asyncio.to_thread(lambda: list(collector.collect()))

    assert asyncio.run(main()) == []
