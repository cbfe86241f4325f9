import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvfleet.router.priority_queue import PriorityQueue, QueuedRequest, QueueWeights


def req(rid, tenant="a", paid=0.0, at=0.0):
    return QueuedRequest(rid, tenant, paid, at)


def test_equal_paid_levels_run_in_arrival_order():
    q = PriorityQueue(10)
    for i in range(3):
        q.push(req(f"r{i}", at=float(i)), now=float(i))
    assert [q.pop(now=5.0).request_id for _ in range(3)] == ["r0", "r1", "r2"]
    assert q.pop(now=5.0) is None


def test_paid_level_beats_a_short_wait_but_not_a_long_one():
    q = PriorityQueue(10)
    q.push(req("cheap", "free", paid=0.0, at=0.0), now=0.0)
    q.push(req("paid", "gold", paid=1.0, at=9.0), now=9.0)
    # cheap: 0.4 · 1 = 0.4; paid: 0.6 + 0.4 · 0.1 = 0.64
    assert q.pop(now=10.0).request_id == "paid"
    q = PriorityQueue(10, weights=QueueWeights(paid=0.2, wait=0.8))
    q.push(req("cheap", "free", paid=0.0, at=0.0), now=0.0)
    q.push(req("paid", "gold", paid=1.0, at=9.0), now=9.0)
    assert q.pop(now=10.0).request_id == "cheap"


def test_concurrency_limit_skips_the_tenant_without_blocking_others():
    q = PriorityQueue(10, concurrency_limits={"gold": 1})
    q.push(req("g1", "gold", 1.0), 0.0)
    q.push(req("g2", "gold", 1.0), 0.0)
    q.push(req("f1", "free", 0.0), 0.0)
    assert q.pop(1.0).request_id == "g1"
    assert q.num_running("gold") == 1
    assert q.pop(1.0).request_id == "f1"  # g2 waits for gold's slot
    assert not q.can_pop() and q.pop(1.0) is None
    q.finish("gold")
    assert q.can_pop() and q.pop(1.0).request_id == "g2"


def test_capacity_holds_everyone_back_until_a_slot_frees():
    q = PriorityQueue(10, capacity=2)
    for i, (tenant, paid) in enumerate([("free", 0.0), ("free", 0.0), ("free", 0.0), ("gold", 1.0)]):
        q.push(req(f"r{i}", tenant, paid, float(i)), float(i))
    assert q.pop(4.0).request_id == "r3" and q.pop(4.0).request_id == "r0"
    assert q.num_running() == 2 and not q.can_pop() and q.pop(4.0) is None
    q.finish("gold")
    assert q.pop(5.0).request_id == "r1"


def test_full_queue_sheds_the_lowest_score():
    q = PriorityQueue(2)
    q.push(req("old-free", "free", 0.0, 0.0), 0.0)
    q.push(req("new-free", "free", 0.0, 5.0), 5.0)
    # A newcomer that scores no higher is itself shed.
    assert q.push(req("newer-free", "free", 0.0, 6.0), 6.0).request_id == "newer-free"
    # A paid newcomer displaces the lowest-scoring queued request.
    assert q.push(req("gold", "gold", 1.0, 7.0), 7.0).request_id == "new-free"
    assert len(q) == 2 and "gold" in q and "old-free" in q


def test_remove_and_duplicates():
    q = PriorityQueue(3)
    q.push(req("a"), 0.0)
    with pytest.raises(ValueError, match="already queued"):
        q.push(req("a"), 0.0)
    assert q.remove("a").request_id == "a" and q.remove("a") is None and len(q) == 0


def test_bad_configuration():
    with pytest.raises(ValueError):
        PriorityQueue(0)
    with pytest.raises(ValueError):
        PriorityQueue(1, capacity=0)
    with pytest.raises(ValueError):
        QueueWeights(0, 0)
    with pytest.raises(ValueError):
        QueuedRequest("x", "t", 1.5, 0.0)


@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 1), st.booleans()), max_size=40))
def test_never_exceeds_bounds(ops):
    """Whatever arrives, the queue holds at most max_size and no tenant runs over its limit."""
    limits = {"a": 1, "b": 2, "c": 3}
    q = PriorityQueue(5, concurrency_limits=limits, capacity=4)
    running: list[str] = []
    for i, (tenant, paid, pop) in enumerate(ops):
        now = float(i)
        q.push(req(f"r{i}", tenant, paid, now), now)
        assert len(q) <= 5
        if pop:
            item = q.pop(now)
            if item is not None:
                running.append(item.tenant)
        elif running:
            q.finish(running.pop(0))
        for t, limit in limits.items():
            assert q.num_running(t) == running.count(t) <= limit
        assert q.num_running() == len(running) <= 4


def test_a_long_wait_outranks_any_paid_level():
    """Gold (paid 1) arriving 1.5 · wait_scale_s or more after a free request no longer goes first:
    0.6 · 1 + 0.4 · w / s < 0.4 · (w + 1.5 s) / s."""
    weights = QueueWeights(wait_scale_s=2.0)
    for gap, first in [(2.9, "gold"), (3.1, "free")]:
        q = PriorityQueue(10, weights=weights)
        q.push(req("free", "free", 0.0, at=0.0), 0.0)
        q.push(req("gold", "gold", 1.0, at=gap), gap)
        assert q.pop(now=10.0).request_id == first, gap


@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 5), st.booleans()), min_size=1, max_size=30),
       st.floats(0.1, 5))
def test_no_request_is_overtaken_by_one_arriving_past_the_paid_gap_in_wait(arrivals, scale):
    """The bound the cluster test relies on: request s runs before an older r only if it arrived
    less than (0.6 / 0.4) · wait_scale_s · (paid_s − paid_r) after r."""
    q = PriorityQueue(100, weights=QueueWeights(wait_scale_s=scale), capacity=1)
    now, queued = 0.0, {}
    for i, (paid, gap, pop) in enumerate(arrivals):
        now += gap
        q.push(req(f"r{i}", "t", paid, now), now)
        queued[f"r{i}"] = (now, paid)
        if pop:
            chosen = q.pop(now)
            q.finish("t")
            at, p = queued.pop(chosen.request_id)
            for other_at, other_paid in queued.values():  # every request left behind
                assert not (other_at < at and at - other_at >= 1.5 * scale * (p - other_paid) + 1e-9)


def test_capacity_can_change():
    q = PriorityQueue(10, capacity=1)
    q.push(req("a"), 0.0)
    q.push(req("b"), 0.0)
    assert q.pop(1.0).request_id == "a" and q.pop(1.0) is None
    q.set_capacity(2)
    assert q.pop(1.0).request_id == "b"
    q.set_capacity(None)
    with pytest.raises(ValueError):
        q.set_capacity(0)
