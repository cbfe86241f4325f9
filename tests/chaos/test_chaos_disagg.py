"""A prefill node and a decode node die under streaming load and come back (prefill and decode on
separate nodes, every prompt past a block handed over): the checker's whole list holds — every
token exact, none lost or repeated, no block leaked, the quotas' books balanced. A dead prefill
node's requests are retried on the decode node (it serves whole requests while no prefill node is
READY); a dead decode node's are resumed on the prefill node (the only node left serves them whole)."""

from __future__ import annotations

import asyncio

import pytest
from chaos_checker import report
from chaos_cluster import NODE_DOWN, kill_and_restart, start_cluster
from test_chaos_restarts import PROMPTS, _under_load  # noqa: F401 - PROMPTS: the book's prompts (conftest)

from kvfleet.cli.local_nodes import node_roles


@pytest.fixture(scope="module")
def cluster(chaos_model, tmp_path_factory):
    c = start_cluster(chaos_model, tmp_path_factory.mktemp("chaos-disagg"), roles=node_roles(2, prefill=1, decode=1),
                      router_args=("--disagg-min-uncached-tokens", "16"))
    try:
        yield c
    finally:
        c.stop()
        assert not [child.name for child in c.children() if child.alive()]


@pytest.mark.parametrize("node", ["node-0", "node-1"], ids=["prefill-node", "decode-node"])
def test_a_disaggregated_node_sigkill_and_restart(cluster, checker, node):
    problems = asyncio.run(_under_load(cluster, checker, kill_and_restart(cluster, node), NODE_DOWN,
                                       frozenset({node})))
    assert not problems, report(problems)
