"""Which unacknowledged writes the page-table client releases later (``history.maybe_held``): an
allocation whose call timed out or broke may be held at the leader, and kept it would fill the
tenant's quota over a long lossy soak (every allocation refused after ~150 s of 300)."""

from kvfleet.cli.partition.history import maybe_held, release_unsettled


def test_an_allocation_without_an_answer_may_be_held():
    assert maybe_held("alloc", False, "AioRpcError")     # timed out or broke
    assert maybe_held("alloc", False, "Unavailable")      # the leader applied it, the durable mark failed


def test_answers_hold_nothing_more_than_they_say():
    assert not maybe_held("alloc", False, "Refusal")      # the pool or the quota said no
    assert not maybe_held("alloc", False, "NotLeader")    # a standby applies nothing
    assert not maybe_held("alloc", True, "")              # acknowledged: released as such
    assert not maybe_held("release", False, "AioRpcError")


def test_a_release_no_replica_answered_is_made_again():
    assert release_unsettled([(False, "AioRpcError"), (False, "NotLeader")])
    assert not release_unsettled([(True, ""), (False, "NotLeader")])
    assert not release_unsettled([(False, "NotFound"), (False, "NotLeader")])  # gone already
