import asyncio

import pytest

from router.admission import Admission, Shed
from router.priority_queue import PriorityQueue


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
