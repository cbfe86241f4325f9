"""etcd as three members in the partition bed (``BedCluster(..., etcd_members=3)``): the member every
service and client starts on is cut off from everyone for three lease TTLs. The fleet moves to the
other two (kvfleet.core.etcd_failover); nothing acknowledged is lost, nothing granted twice, no split
brain, no wrong token, no tenant over quota, and no process dies of it. A bed of its own (this
module's ``bed_cluster``, over the one-member one of conftest.py), so it costs its own start."""

from __future__ import annotations

import pytest

from kvfleet.cli.partition.scenarios import ETCD_MEMBER_SCENARIOS, MAX_TOKENS, run_scenario
from tests.partition.beds import started_bed
from tests.partition.test_partitions import CLEAN, _evidence


@pytest.fixture(scope="module")
def bed_cluster(tmp_path_factory):
    """(a started BedCluster with three etcd members, its prompts, their fault-free tokens)."""
    yield from started_bed(tmp_path_factory, "partition-etcd3", etcd_members=3)


def test_the_etcd_member_everyone_talks_to_is_cut_off(bed_cluster, tmp_path):
    cluster, prompt_list, reference = bed_cluster
    assert cluster.etcd_url.count("https://") == 3
    result = run_scenario(cluster, ETCD_MEMBER_SCENARIOS["etcd_member_cut_off"], reference, prompt_list, MAX_TOKENS,
                          history_dir=tmp_path)
    logs = {n: cluster.log_tail(n, 15) for n in result["exited"]}
    assert {k: result[k] for k in CLEAN} == dict.fromkeys(CLEAN, 0), f"{_evidence(result)}\n{result}\n{logs}"
    assert result["exited"] == {}, logs
    assert result["acknowledged_writes"] > 0 and result["streams"] > len(prompt_list), result
    print(f"etcd_member_cut_off: leader {result['leader_before']} -> {result['leader_after']}, "
          f"unavailable_s {result['unavailable_s']}, recovered {result['recovered_after_heal_s']} s after the heal")
