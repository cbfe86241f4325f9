"""A replica whose state ends before the last leader's durable mark must not lead."""

from __future__ import annotations

import json

from kvfleet.block_service.durable_mark import behind


def mark(lineage: str, lsn: int) -> bytes:
    return json.dumps({"lineage": lineage, "lsn": lsn}).encode()


def test_a_state_behind_the_mark_of_its_own_lineage_may_not_lead():
    assert behind(mark("L", 120), "L", 100) == 120


def test_a_state_at_or_past_the_mark_may_lead():
    assert behind(mark("L", 120), "L", 120) is None
    assert behind(mark("L", 120), "L", 121) is None


def test_another_lineage_or_an_empty_directory_does_not_hold_the_history():
    assert behind(mark("other", 500), "L", 900) == 500
    assert behind(mark("L", 500), None, 0) == 500


def test_a_garbled_mark_holds_no_replica_back():
    assert behind(b"not json", "L", 0) is None
    assert behind(b'{"lsn": 3}', "L", 0) is None
