"""Node groups: a valid id on the node's flag, in its membership record, on its metrics, in ``kvfleet blocks``."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvfleet.block_service.blocks_report import BlocksReport, NodeBlocks, render, to_json
from kvfleet.block_service.page_table import PageTable
from kvfleet.compute_service.engine.stats import EngineStats
from kvfleet.compute_service.node import metrics
from kvfleet.compute_service.node.settings import NodeCommand
from kvfleet.core.allocator import AllocatorStats
from kvfleet.core.groups import CANARY, STABLE, check_group, side
from kvfleet.core.membership import NodeInfo, NodeState
from kvfleet.core.metric_families import registry_of
from kvfleet.core.settings import SettingError


@pytest.mark.parametrize("bad", ["", "a b", "x/y", "g" * 65, 3, None])
def test_a_group_is_an_id(bad) -> None:
    with pytest.raises(ValueError, match="group must be"):
        check_group(bad)


def test_canary_is_one_side_every_other_group_the_stable_one() -> None:
    assert check_group("canary-2.b_c") == "canary-2.b_c"
    assert side(CANARY) == CANARY
    assert side(STABLE) == side("blue") == STABLE


def test_the_group_travels_in_the_membership_record_and_defaults_to_stable() -> None:
    info = NodeInfo("n1", "127.0.0.1:1", "/m", 8, 16, NodeState.READY, group=CANARY)
    assert NodeInfo.from_json("n1", info.to_json()) == info
    old = json.loads(info.to_json())
    del old["group"]  # a record written before the field existed
    assert NodeInfo.from_json("n1", json.dumps(old).encode()).group == STABLE
    with pytest.raises(ValueError):
        NodeInfo.from_json("n1", dataclasses.replace(info, group="no spaces").to_json())


def test_the_node_flag_refuses_a_bad_group_in_one_line() -> None:
    assert NodeCommand("/m", "n1").group == STABLE
    with pytest.raises(SettingError, match="^--group must be") as err:
        NodeCommand("/m", "n1", group="two words")
    assert "\n" not in str(err.value)


def test_the_node_group_gauge_joins_onto_the_node_label() -> None:
    stats = EngineStats(num_running=0, num_waiting=0, max_num_seqs_live=0, num_preemptions=0, generated_tokens=0,
                        prompt_tokens_computed=0, busy_seconds=0.0,
                        blocks=AllocatorStats(num_blocks=8, num_free=8, num_cached=0, num_used=0, prefix_queries=0,
                                              prefix_hits=0))
    sample = metrics.NodeSample("node-0", "READY", 16, 0, stats, group=CANARY)
    r = registry_of(metrics.families(sample))
    assert r.get_sample_value("kvfleet:node_group", {"node": "node-0", "group": CANARY}) == 1
    assert r.get_sample_value("kvfleet:node_group", {"node": "node-0", "group": STABLE}) is None


def test_kvfleet_blocks_shows_the_group_next_to_the_role() -> None:
    table = PageTable()
    table.register_node("n0", 32, 16, 1 << 16)
    report = BlocksReport([NodeBlocks(table.node_stats("n0"), role="mixed", group=CANARY)], [])
    assert render(report).startswith("node n0 (mixed, group canary): 32 blocks")
    assert to_json(report)["nodes"][0]["group"] == CANARY
    assert render(BlocksReport([NodeBlocks(table.node_stats("n0"))], [])).startswith("node n0: 32 blocks")
