"""Prefix groups in the router: the salt is decided from the tenant (its API key → its prefix_group),
never from the client. Lookups hash with the group, every ComputeRequest carries it (a resume and a
hand-over too), the OpenAI door refuses vLLM's ``cache_salt``, and the public API has no field for
it. Fake nodes, no processes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from test_disagg import LONG, with_roles
from test_relay import LENGTH, failure, relay, stub, table

from kvfleet.core.membership import NodeInfo, NodeState
from kvfleet.core.roles import DECODE, PREFILL
from kvfleet.core.sampling import SamplingParams
from kvfleet.core.tenants import parse_tenants
from kvfleet.router.nodes import RouterNode
from kvfleet.router.openai_requests import ApiError, parse_call
from kvfleet.router.prefix_lookup import BlockServicePrefixLookup
from kvfleet.router.request import ParsedRequest
from kvfleet.router.tenants import TenantDirectory
from kvfleet.v1 import inference_pb2

DIRECTORY = TenantDirectory(parse_tenants({"prefix_groups": ["org"], "tenants": [
    dict(name="a", api_key="ka", quota_mib=4, paid_level=0, max_concurrent=0, prefix_group="org"),
    dict(name="b", api_key="kb", quota_mib=4, paid_level=0, max_concurrent=0, prefix_group="org"),
    dict(name="c", api_key="kc", quota_mib=4, paid_level=0, max_concurrent=0),
]}))
PROMPT = list(range(64))


def node(node_id: str) -> RouterNode:
    return RouterNode(NodeInfo(node_id, f"{node_id}:1", "m", 64, 16, NodeState.READY), None, None)


def test_lookups_hash_with_the_group_the_api_key_names():
    a, b, c = (DIRECTORY.authenticate(f"Bearer k{t}") for t in "abc")
    lookup, n0, n1 = BlockServicePrefixLookup(), node("n0"), node("n1")
    lookup.routed(a.name, PROMPT, n0, prefix_group=a.prefix_group)

    def held(tenant):
        return asyncio.run(lookup.match(tenant.name, PROMPT, [n0, n1], prefix_group=tenant.prefix_group or ""))

    assert held(b)["n0"].hot == 4  # a group mate: a's blocks count for it
    assert held(c) == {}           # outside the group: none
    assert lookup._hashes("a", PROMPT, 16, "org") == lookup._hashes("b", PROMPT, 16, "org") != lookup._hashes("a", PROMPT, 16)


def run_as(nodes, tenant, max_tokens=5, **options):
    req = ParsedRequest("r", "r-1", [1, 2, 3], SamplingParams(max_tokens=max_tokens))

    async def collect():
        return [c async for c in relay(nodes, **options).run(req, tenant)]

    return asyncio.run(collect())


def test_every_attempt_carries_the_routers_decision():
    a, c = DIRECTORY.by_name("a"), DIRECTORY.by_name("c")
    died = failure(grpc.StatusCode.UNAVAILABLE, "socket closed")
    nodes = table({"x": [([10, 11], died)], "y": [([12, 13, 14], LENGTH)]})
    nodes.nodes["y"].active_blocks = 1  # "x" first; it dies; "y" resumes
    run_as(nodes, a)
    first, resumed = stub(nodes, "x").requests[0], stub(nodes, "y").requests[0]
    assert first.prefix_group == resumed.prefix_group == "org" and resumed.num_resumed_tokens == 2
    handed = with_roles(table({"p": [([10], LENGTH)], "d": [([11, 12, 13, 14], LENGTH)]}), p=PREFILL, d=DECODE)
    run_as(handed, a, disagg=LONG)
    assert stub(handed, "p").requests[0].prefix_group == stub(handed, "d").requests[0].prefix_group == "org"
    alone = table({"x": [([10], LENGTH)]})
    run_as(alone, c, max_tokens=1)
    assert stub(alone, "x").requests[0].prefix_group == ""  # no group: salted with its own name


def test_the_openai_door_refuses_a_clients_cache_salt_in_one_line():
    for kind, body in (("completion", {"model": "m", "prompt": "hi", "cache_salt": "x"}),
                       ("chat", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": ""})):
        with pytest.raises(ApiError) as e:
            parse_call(body, kind)
        assert e.value.status == 400 and e.value.param == "cache_salt" and "\n" not in str(e.value)
        assert "API key" in str(e.value) and "prefix_group" in str(e.value)


def test_nothing_in_a_generate_request_lets_a_client_choose_the_salt():
    seen, todo = set(), [inference_pb2.GenerateRequest.DESCRIPTOR]
    names = []
    while todo:
        message = todo.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        for f in message.fields:
            names.append(f"{message.name}.{f.name}")
            if f.message_type is not None:
                todo.append(f.message_type)
    assert names and not [n for n in names if any(w in n.lower() for w in ("salt", "group", "tenant", "extra"))]
