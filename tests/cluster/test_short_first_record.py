"""A node that lets short prompts first publishes its threshold, for the routers' load model
(kvfleet/router/routing.py, ``load_for``): read back from a real etcd, as a router reads it."""

from __future__ import annotations

import asyncio

import pytest

from kvfleet.core.membership import etcd_client, list_nodes

pytestmark = pytest.mark.process


def records(cluster) -> dict:
    async def read():
        async with etcd_client(cluster.etcd.url) as client:
            nodes, _ = await list_nodes(client)
        return nodes

    return asyncio.run(read())


def test_each_node_publishes_its_long_prefill_threshold(start_cluster):
    cluster = start_cluster(2, compute_args=("--long-prefill-token-threshold", "64"))
    assert {n: (i.long_prefill_token_threshold, i.block_size) for n, i in records(cluster).items()} == {
        "node-0": (64, 16), "node-1": (64, 16)}
