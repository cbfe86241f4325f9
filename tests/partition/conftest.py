"""The partition bed's fixtures: one cluster in network namespaces per module (a start costs ~30 s),
stopped and its namespaces removed even when a test fails; a clear skip where namespaces cannot be
made (not root, no ``ip``/``iptables``)."""

from __future__ import annotations

import pytest

from tests.partition.beds import started_bed


@pytest.fixture(scope="module")
def bed_cluster(tmp_path_factory):
    """(a started BedCluster, its prompts, their fault-free tokens)."""
    yield from started_bed(tmp_path_factory, "partition")
