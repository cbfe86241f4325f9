"""A standby's reset to the leader's snapshot is marked while it runs: a replica that crashed half
way must not lead until it has followed a leader again."""

from __future__ import annotations

import asyncio
import os

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.lineage import RESET_MARKER, mark_reset, reset_interrupted
from kvfleet.block_service.page_table import PageTable


def test_reset_clears_its_marker_and_a_leftover_marker_is_seen(tmp_path):
    leader = PageTable()
    leader.register_node("n", 8, 16, 1024)
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    assert not reset_interrupted(str(tmp_path))
    asyncio.run(store.reset(5, leader.to_dict()))
    assert not os.path.exists(tmp_path / RESET_MARKER), "a finished reset leaves no marker"
    assert not reset_interrupted(str(tmp_path))
    mark_reset(str(tmp_path))  # as a crash between removing the old state and writing the new leaves it
    assert reset_interrupted(str(tmp_path))
