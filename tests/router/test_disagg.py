"""Prefill/decode hand-overs in the relay (fake nodes, no processes) and the decision's rule."""

from __future__ import annotations

import dataclasses

import grpc
from test_relay import LENGTH, failure, run, stub, table

from kvfleet.core.roles import DECODE, MIXED, PREFILL
from kvfleet.router.disagg import DisaggConfig, hand_over

STOP = 1  # inference_pb2.FINISH_REASON_STOP


def with_roles(nodes, **roles):
    for node_id, role in roles.items():
        node = nodes.nodes[node_id]
        node.info = dataclasses.replace(node.info, role=role)
    return nodes


LONG = DisaggConfig(disagg_min_uncached_tokens=2)  # the test prompt is 3 tokens


def test_a_long_prompt_is_prefilled_then_handed_over_with_one_stream():
    nodes = with_roles(table({"p": [([10], LENGTH)], "d": [([11, 12, 13, 14], LENGTH)]}), p=PREFILL, d=DECODE)
    chunks = run(nodes, disagg=LONG)
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14]
    assert [c.node_id for c in chunks] == ["p", "d", "d", "d", "d"]
    first, then = stub(nodes, "p").requests[0], stub(nodes, "d").requests[0]
    assert first.sampling.max_tokens == 1 and not first.kv_source_node_id
    assert list(then.prompt_token_ids) == [1, 2, 3, 10] and then.num_resumed_tokens == 1
    assert then.kv_source_node_id == "p" and then.sampling.max_tokens == 5 and then.request_id == "r-1.1"
    assert stub(nodes, "p").finished == [("r-1", False)]  # its part ended: nothing to cancel
    assert chunks[-1].finish_reason == LENGTH and chunks[-1].usage.completion_tokens == 5


def test_a_request_whose_first_token_ends_it_is_not_handed_over():
    nodes = with_roles(table({"p": [([10], STOP)], "d": []}), p=PREFILL, d=DECODE)
    chunks = run(nodes, disagg=LONG)
    assert [t for c in chunks for t in c.token_ids] == [10] and chunks[-1].finish_reason == STOP
    one = run(with_roles(table({"p": [], "d": [([10], LENGTH)]}), p=PREFILL, d=DECODE), max_tokens=1, disagg=LONG)
    assert [c.node_id for c in one] == ["d"]  # one token wanted: nothing to hand over


def test_short_prompts_and_clusters_without_prefill_nodes_run_where_they_land():
    nodes = with_roles(table({"p": [], "d": [([10, 11, 12, 13, 14], LENGTH)]}), p=PREFILL, d=DECODE)
    assert {c.node_id for c in run(nodes, disagg=DisaggConfig(disagg_min_uncached_tokens=4))} == {"d"}
    mixed = with_roles(table({"a": [([10, 11, 12, 13, 14], LENGTH)]}), a=MIXED)
    assert {c.node_id for c in run(mixed, disagg=LONG)} == {"a"}
    only_prefill = with_roles(table({"p": [([10, 11, 12, 13, 14], LENGTH)]}), p=PREFILL)
    chunks = run(only_prefill, disagg=LONG)  # no node to decode on: the prefill node serves it whole
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14]
    assert stub(only_prefill, "p").requests[0].sampling.max_tokens == 5


def test_a_prefill_node_failing_before_its_token_is_a_retry_and_a_decode_node_failing_a_resume():
    died = failure(grpc.StatusCode.UNAVAILABLE, "socket closed")
    nodes = with_roles(table({"p": [([], died)], "d": [([10, 11, 12, 13, 14], LENGTH)]}), p=PREFILL, d=DECODE)
    chunks = run(nodes, disagg=LONG)
    assert [c.node_id for c in chunks] == ["d"] * 5 and not stub(nodes, "d").requests[0].kv_source_node_id
    nodes = with_roles(table({"p": [([10], LENGTH)], "d": [([11], died)], "e": [([12, 13, 14], LENGTH)]}),
                       p=PREFILL, d=DECODE, e=DECODE)
    nodes.nodes["e"].active_blocks = 5  # "d" is chosen first
    chunks = run(nodes, disagg=LONG)
    assert [t for c in chunks for t in c.token_ids] == [10, 11, 12, 13, 14]
    resumed = stub(nodes, "e").requests[0]
    assert list(resumed.prompt_token_ids) == [1, 2, 3, 10, 11] and resumed.num_resumed_tokens == 2


def test_the_rule():
    config = DisaggConfig(disagg_min_uncached_tokens=512)
    assert hand_over(config, 4096, 0, 1, 1, 0, 64, False)
    assert not hand_over(config, 4096, 3700, 1, 1, 0, 64, False)  # mostly cached where it would decode
    assert not hand_over(config, 4096, 0, 0, 1, 0, 64, False)     # no prefill node
    assert not hand_over(config, 4096, 0, 1, 0, 0, 64, False)     # nothing to decode on
    assert not hand_over(config, 4096, 0, 1, 1, 3, 64, False)     # resumed mid-stream
    assert not hand_over(config, 4096, 0, 1, 1, 0, 64, True)      # handed over already
    assert not hand_over(config, 4096, 0, 1, 1, 0, 1, False)      # one token
