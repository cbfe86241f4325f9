"""Short partition scenarios against a real cluster whose services each live in a network namespace
(``kvfleet.cli.partition``): the fault, the heal, and the checker over what the clients recorded.
Nothing acknowledged may be lost, no block granted twice, no two replicas accepting writes at once,
no token wrong, no tenant over quota, and no process may die of it. The full set with its figures is
``bench/partitions.py``."""

from __future__ import annotations

import json

from kvfleet.cli.partition.scenarios import MAX_TOKENS, SCENARIOS, run_scenario

CLEAN = ("lost_acknowledged", "double_grants", "split_brain_writes", "wrong_tokens", "over_quota")


def _evidence(result: dict) -> str:
    """Each violation with its records, one JSON line each, and where the whole history is."""
    lines = [f"{kind}: {json.dumps(v)}" for kind, found in result["violations"].items() for v in found]
    return "\n".join([*lines, f"history: {result['history']}"])


def _run(bed_cluster, name: str, history_dir) -> dict:
    cluster, prompt_list, reference = bed_cluster
    result = run_scenario(cluster, SCENARIOS[name], reference, prompt_list, MAX_TOKENS, history_dir=history_dir)
    logs = {n: cluster.log_tail(n, 15) for n in result["exited"]}
    assert {k: result[k] for k in CLEAN} == dict.fromkeys(CLEAN, 0), f"{_evidence(result)}\n{result}\n{logs}"
    assert result["exited"] == {}, logs
    assert result["acknowledged_writes"] > 0 and result["streams"] > len(prompt_list), result
    return result


def test_a_leader_cut_off_from_etcd_and_the_standby_is_replaced_and_loses_nothing(bed_cluster, tmp_path):
    result = _run(bed_cluster, "leader_isolated", tmp_path)
    assert result["leader_after"] != result["leader_before"], result  # the standby took over


def test_a_node_cut_off_from_the_router_only(bed_cluster, tmp_path):
    _run(bed_cluster, "node_cut_from_router", tmp_path)


def test_a_one_way_cut_from_the_leader_to_etcd(bed_cluster, tmp_path):
    result = _run(bed_cluster, "one_way_leader_to_etcd", tmp_path)
    assert result["leader_after"] != result["leader_before"], result  # its keep-alives never arrived


def test_a_one_way_cut_while_the_standby_lags_loses_nothing_the_old_leader_acknowledged(bed_cluster, tmp_path):
    """Issue 34's double grant, made likely: the old leader acknowledges alone (its standby is
    stalled, out of sync) until it fences; the standby takes over only with those records."""
    result = _run(bed_cluster, "one_way_standby_lagging", tmp_path)
    assert result["leader_after"] != result["leader_before"], result


def test_the_leader_cut_off_from_the_nodes_only_steps_down(bed_cluster, tmp_path):
    """It keeps its lease (etcd and the standby still reach it), but every node says in etcd that it
    cannot reach it: it resigns and the standby leads (kvfleet/block_service/step_down.py)."""
    result = _run(bed_cluster, "leader_cut_from_nodes", tmp_path)
    assert result["leader_after"] != result["leader_before"], result


def test_a_node_cut_off_from_both_replicas_does_not_depose_the_leader(bed_cluster, tmp_path):
    """Only that node complains; the other reaches the leader, so the trouble is the node's."""
    result = _run(bed_cluster, "node_cut_from_block_service", tmp_path)
    assert result["leader_after"] == result["leader_before"], result
