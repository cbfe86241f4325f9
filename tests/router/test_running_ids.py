import pytest

from kvfleet.router.running_ids import AlreadyRunning, RunningIds


def test_an_id_runs_once_at_a_time_per_tenant():
    ids = RunningIds()
    ids.claim("gold", "r1")
    with pytest.raises(AlreadyRunning, match="request_id r1 is already running"):
        ids.claim("gold", "r1")
    ids.claim("free", "r1")  # another tenant's r1 is another request
    ids.claim("gold", "r2")
    assert len(ids) == 3 and ids.is_running("gold", "r1")

    ids.release("gold", "r1")  # over: the id may be used again
    assert not ids.is_running("gold", "r1") and ids.is_running("free", "r1")
    ids.claim("gold", "r1")
    assert len(ids) == 3


def test_releasing_an_id_never_claimed_is_a_bug():
    with pytest.raises(AssertionError):
        RunningIds().release("gold", "r1")
