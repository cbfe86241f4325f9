"""A lease refresh whose answer is slow but within the fence keeps the leadership (in-process, a
fake etcd whose every answer takes 1.5 s; TTL 6: a refresh every 1 s, the fence 3 s after a success
was sent). Tries used to be cut at half the time left to the fence (1 s for the first), and those
after it got less than a round trip: the lossy soak's leaders (0.4-0.6 s round trips with 10% loss)
fenced every ~10 s at TTL 5."""

import asyncio
from types import SimpleNamespace

import aetcd

from kvfleet.block_service.election import Election
from kvfleet.core.leader import Leader

ANSWER_S = 1.5


class _SlowEtcd:
    """What ``Election`` calls, each answered after ``ANSWER_S`` (the campaign at once)."""

    transactions = aetcd.client.Transactions()

    def __init__(self, answers_s: tuple[float, ...] = (ANSWER_S,)) -> None:
        self.answers_s = answers_s  # each refresh's answer time in turn, round and round
        self.refreshes = 0
        self.sent = 0

    async def lease(self, ttl):
        return SimpleNamespace(id=7, ttl=ttl)

    async def transaction(self, compare, success, failure):
        return True, [SimpleNamespace(response_put=SimpleNamespace(header=SimpleNamespace(revision=1)))]

    async def refresh_lease(self, lease_id):
        self.sent += 1
        await asyncio.sleep(self.answers_s[(self.sent - 1) % len(self.answers_s)])
        self.refreshes += 1
        return SimpleNamespace(TTL=6)

    async def get(self, key):
        return SimpleNamespace(lease=7)

    async def watch(self, key, start_revision=None):
        raise ConnectionError("no watch here: the refreshes decide")

    async def revoke_lease(self, lease_id):
        return None


async def _lead_for(etcd: _SlowEtcd, seconds: float) -> tuple[bool, int]:
    election = Election(etcd, Leader("a:1", "L"), ttl_s=6)
    assert await election.campaign()
    leading = asyncio.create_task(election.lead())
    await asyncio.sleep(seconds)
    held = election.holds() and not leading.done()
    await election.resign()
    await asyncio.wait_for(leading, 5)
    return held, etcd.refreshes


def test_a_slow_answer_within_the_fence_keeps_the_lead():
    # two fences' worth: without a 1.5 s answer counted it would have fenced twice
    held, refreshes = asyncio.run(_lead_for(_SlowEtcd(), 7.0))
    assert held and refreshes >= 3


def test_a_later_try_answering_first_ends_the_older_one_and_counts():
    # the first try of each pair answers in 1.9 s (within its fence), the one sent beside it in 0.2 s
    held, refreshes = asyncio.run(_lead_for(_SlowEtcd((1.9, 0.2)), 7.0))
    assert held and refreshes >= 3


class _FrozenEtcd(_SlowEtcd):
    """Every refresh sent from ``FROZEN_S[0]`` on is answered at ``FROZEN_S[1]`` at the earliest (as
    over a connection that broke and took its TLS reconnect across the lossy link), the others at once."""

    FROZEN_S = (0.5, 4.0)

    def __init__(self) -> None:
        super().__init__((0.0,))
        self.t0 = asyncio.get_running_loop().time()

    async def refresh_lease(self, lease_id):
        now = asyncio.get_running_loop().time() - self.t0
        if now >= self.FROZEN_S[0]:
            await asyncio.sleep(max(self.FROZEN_S[1] - now, 0.0))
        return await super().refresh_lease(lease_id)


def test_an_answer_past_the_fence_but_before_the_lease_can_lapse_resumes_the_same_term():
    """TTL 6: the fence 3 s after the campaign was sent, the lease's earliest lapse 6 s after; etcd
    answers nothing from 0.5 s to 4 s. Past the fence no write is accepted; the try sent at the fence
    answers at 4 s, proving the lease alive, and the same replica holds again (the term was ended at
    the fence: a takeover for every late answer)."""
    async def run() -> tuple[bool, bool, bool]:
        etcd = _FrozenEtcd()
        election = Election(etcd, Leader("a:1", "L"), ttl_s=6)
        assert await election.campaign()
        leading = asyncio.create_task(election.lead())
        await asyncio.sleep(3.5)
        fenced = not election.holds()
        await asyncio.sleep(1.5)
        resumed = election.holds() and not leading.done()
        await election.resign()
        await asyncio.wait_for(leading, 5)
        return fenced, resumed, etcd.refreshes >= 1

    assert asyncio.run(run()) == (True, True, True)


class _StalledEtcd(_SlowEtcd):
    """A connection that stops answering at ``STALL_AT_S`` (the kernel will give it up): every refresh
    sent from then on waits forever."""

    STALL_AT_S = 0.5

    def __init__(self) -> None:
        super().__init__((0.0,))
        self.t0 = asyncio.get_running_loop().time()

    async def refresh_lease(self, lease_id):
        if asyncio.get_running_loop().time() - self.t0 >= self.STALL_AT_S:
            await asyncio.Event().wait()
        return await super().refresh_lease(lease_id)


def test_with_a_spare_connection_a_stalled_one_costs_no_refresh():
    """TTL 6 (the fence 3 s after a success was sent, the lapse 6 s after): the election's connection
    stalls at 0.5 s for good; each try goes on the spare too, whose answers keep the lease, so the
    leader holds throughout, past where the lease would have lapsed without it."""
    async def run() -> tuple[bool, int]:
        stalled, spare = _StalledEtcd(), _SlowEtcd((0.1,))
        election = Election(stalled, Leader("a:1", "L"), ttl_s=6, spare=spare)
        assert await election.campaign()
        leading = asyncio.create_task(election.lead())
        held = True
        for _ in range(16):  # 8 s: past the fence (3.5 s) and the lapse (6.5 s) of the stalled connection
            await asyncio.sleep(0.5)
            held = held and election.holds() and not leading.done()
        await election.resign()
        await asyncio.wait_for(leading, 5)
        return held, spare.refreshes

    held, refreshes = asyncio.run(run())
    assert held and refreshes >= 6
