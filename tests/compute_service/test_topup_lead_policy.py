"""The top-up lead (issue 34, later block boundaries), as the pure policy sees it: a reserve
top-up goes the steps of two measured round trips to block_service earlier, is asked once, and on
a link slower than a block's decoding brings more than one block (``topup_lead.py``)."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.blocks.allocator_policy import TOPUP_MARGIN, AllocatorPolicy
from kvfleet.compute_service.blocks.topup_lead import MAX_RESERVE_BLOCKS, Pace, lead_steps, reserve_blocks
from kvfleet.core.allocator import Allocation
from tests.compute_service.test_allocator_policy import BS, refusal, steps_until_sent


@pytest.mark.parametrize("round_trip, step, sent_after", [
    (None, None, 32 - 20 - TOPUP_MARGIN + 1),          # nothing measured: the margin alone, as before
    (0.125, 0.0625, 32 - 20 - TOPUP_MARGIN - 4 + 1),   # two round trips are 4 steps: that much earlier
    (0.5, 0.03125, 1),                                 # longer than the block: with this step, no earlier
])
def test_a_topup_goes_the_steps_of_two_measured_round_trips_earlier(round_trip, step, sent_after):
    policy = AllocatorPolicy(BS)
    policy.set_topup_lead(lead_steps(round_trip, step))
    policy.claim("s", "t", Allocation([0, 1], 0), 20)  # 12 free slots in its 2 blocks
    assert steps_until_sent(policy) == sent_after


def test_a_topup_after_the_reserve_is_handed_over_goes_early_too():
    policy = AllocatorPolicy(BS)
    policy.claim("s", "t", Allocation([0, 1, 2], 0), 32, 48)   # its reserve came with it
    policy.set_topup_lead(5)
    assert policy.extend([("s", 33)]).answers == {"s": [2]}    # the reserve: 15 free slots, top-up queued
    assert steps_until_sent(policy) == 15 - TOPUP_MARGIN - 5 + 1


def test_a_topup_in_flight_is_not_asked_again_and_a_refused_one_is():
    policy = AllocatorPolicy(BS)
    policy.claim("s", "t", Allocation([0, 1, 2], 0), 32, 48)
    policy.extend([("s", 33)])                                 # the reserve handed over: top-up queued
    batch = policy.take()
    assert batch.topups == [("s", 64)]
    policy.extend([("s", 34)])                                 # its answer not back yet
    assert not policy.has_bookkeeping()                        # asked once, not once a step
    policy.fold_topups(batch.topups, [refusal("pool")])
    policy.extend([("s", 35)])
    assert policy.take().topups == [("s", 64)]                 # refused: the next growth asks again


@pytest.mark.parametrize("lead, blocks", [(0, 1), (13, 1), (14, 2), (45, 3), (10_000, MAX_RESERVE_BLOCKS)])
def test_a_lead_longer_than_a_block_keeps_more_reserve_blocks(lead, blocks):
    """A top-up can go no earlier than the hand-over that queues it: when the margin and the lead
    are more steps than a block's decoding, the reserve is as many blocks as they take."""
    assert reserve_blocks(TOPUP_MARGIN + lead, BS) == blocks
    policy = AllocatorPolicy(BS)
    policy.set_topup_lead(lead)
    policy.claim("s", "t", Allocation([0, 1, 2], 0), 32, 48)   # the first allocation's one reserve block
    topups = policy.take().topups
    assert topups == ([("s", (2 + blocks) * BS)] if blocks > 1 else [])  # the rest of it at once
    policy.fold_topups(topups, [list(range(3, 2 + blocks))] * len(topups))
    policy.extend([("s", 33)])                                 # 3 blocks handed
    assert [t for _, t in policy.take().topups] == [(3 + blocks) * BS]


def test_the_pace_leads_only_once_both_the_round_trip_and_the_step_were_measured():
    pace = Pace()
    assert pace.lead_steps() == 0
    pace.round_trip(0.25)
    assert pace.lead_steps() == 0                          # no step yet: as before any measure
    pace.step(0.0625)
    assert pace.lead_steps() == 8                          # 2 x 0.25 s at 1/16 s a step
    for _ in range(100):
        pace.round_trip(0.015625)                          # the link got fast: the lead follows
    assert pace.lead_steps() == 1
