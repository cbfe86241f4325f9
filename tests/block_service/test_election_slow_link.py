"""A lease refresh whose answer is slow but within the fence keeps the leadership (in-process, a
fake etcd whose every answer takes 1.5 s; TTL 6: a refresh every 1 s, the fence 3 s after a success
was sent). Tries used to be cut at half the time left to the fence (1 s for the first), and those
after it got less than a round trip: the lossy soak's leaders (0.4-0.6 s round trips with 10% loss)
fenced every ~10 s at TTL 5."""

import asyncio
from types import SimpleNamespace

import aetcd

from block_service.election import Election
from kvfleet.leader import Leader

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
