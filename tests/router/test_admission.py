import asyncio

import pytest

from kvfleet.router.admission import Admission, Shed
from kvfleet.router.priority_queue import PriorityQueue


def test_waiters_run_by_score_and_shed_when_full():
    order: list[str] = []

    async def main():
        admission = Admission(PriorityQueue(max_size=3, capacity=1))
        release = asyncio.Event()

        async def job(rid, tenant, paid, hold=False):
            await admission.wait(rid, tenant, paid)
            try:
                order.append(rid)
                if hold:
                    await release.wait()
            finally:
                admission.finish(tenant)

        first = asyncio.create_task(job("first", "free", 0.0, hold=True))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(job(f"free{i}", "free", 0.0)) for i in range(2)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(job("gold", "gold", 1.0)))
        await asyncio.sleep(0)
        shed = asyncio.create_task(job("late", "free", 0.0))  # queue full: lowest score goes
        await asyncio.sleep(0)
        with pytest.raises(Shed, match="shed"):
            await shed
        release.set()
        await asyncio.gather(first, *tasks)
        assert admission.queue.num_running() == 0 and len(admission.queue) == 0

    asyncio.run(main())
    assert order == ["first", "gold", "free0", "free1"]


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        admission = Admission(PriorityQueue(max_size=4, capacity=1))
        gate = asyncio.Event()

        async def hold():
            await admission.wait("a", "t", 0.0)
            await gate.wait()
            admission.finish("t")

        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(admission.wait("b", "t", 0.0))
        await asyncio.sleep(0)
        assert "b" in admission.queue
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert "b" not in admission.queue
        gate.set()
        await holder
        assert admission.queue.num_running() == 0

    asyncio.run(main())


def test_a_waiter_cancelled_as_its_turn_comes_gives_its_slot_back():
    """Seen in the soak: a client left while queued, and a finishing request dispatched it in the
    same instant (its future already cancelled, its task not yet told): InvalidStateError in the
    finishing request's handler, and the slot stayed taken for good."""

    async def main():
        admission = Admission(PriorityQueue(max_size=8, capacity=1))
        await admission.wait("running", "t", 0.0)
        queued = asyncio.create_task(admission.wait("queued", "t", 0.0))
        await asyncio.sleep(0)  # it waits in the queue
        queued.cancel()         # its future is cancelled now, its task resumes later
        admission.finish("t")   # the running one ends and dispatches the queue
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert admission.queue.num_running() == 0
        await asyncio.wait_for(admission.wait("next", "t", 0.0), 1.0)  # the slot is free

    asyncio.run(main())


def test_raising_the_capacity_lets_waiters_run_at_once():
    async def main():
        admission = Admission(PriorityQueue(max_size=4, capacity=1))
        await admission.wait("a", "t", 0.0)
        second = asyncio.create_task(admission.wait("b", "t", 0.0))
        await asyncio.sleep(0)
        assert not second.done()
        admission.set_capacity(2)  # a node joined, or one's live cap grew
        await asyncio.wait_for(second, 1.0)
        assert admission.queue.num_running() == 2

    asyncio.run(main())
