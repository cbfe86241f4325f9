"""Issue 34, the later block boundaries: on a link whose round trip is longer than a few engine
steps, a reserve top-up queued when a sequence crosses a block boundary must go early enough that
its answer is back before the next boundary. The bridge measures its ``ApplyMany`` round trip and
the engine's step on a fake clock here: 0.5 s a round trip, 0.03 s a step.
"""

from __future__ import annotations

import types

from kvfleet.block_hash import block_hashes, tenant_extra_key
from tests.compute_service.served_blocks import BS, check_agrees, hashes

ROUND_TRIP_S, STEP_S = 0.5, 0.03


def slow_clock(monkeypatch, client) -> types.SimpleNamespace:
    """The bridge's clock, advanced by hand: each ``ApplyMany`` takes ``ROUND_TRIP_S`` on it."""
    clock = types.SimpleNamespace(now=0.0)
    clock.monotonic = lambda: clock.now
    for module in ("compute_service.blocks.sender", "compute_service.blocks.remote_allocator"):
        monkeypatch.setattr(f"{module}.time", clock, raising=False)
    apply = client.apply

    async def slow_apply(*args, **kwargs):
        clock.now += ROUND_TRIP_S
        return await apply(*args, **kwargs)

    monkeypatch.setattr(client, "apply", slow_apply)
    return clock


def test_a_topup_on_a_slow_link_goes_with_the_step_that_handed_the_reserve_over(node, monkeypatch):
    allocator, on_loop, client = node
    clock = slow_clock(monkeypatch, client)
    ids = list(range(20))
    allocator.allocate("a", "t", hashes(ids), 20)             # two blocks and the reserve
    named = block_hashes(ids + list(range(100, 140)), BS, tenant_extra_key("t"))
    sent_at = []
    for n in range(21, 2 * BS + 2):                           # decode to the first token of block 3
        allocator.begin_step()
        clock.now += STEP_S
        rpcs = allocator.num_rpcs
        allocator.extend([("a", n)])
        allocator.commit([("a", 0, named[0])] if n == 21 else [])  # urgent: a round trip is measured
        allocator.end_step()
        on_loop(allocator.settle())
        if allocator.num_rpcs > rpcs:
            sent_at.append(n)
    # the prompt block's commit at once; the reserve handed over at token 33 is topped up in the
    # same step (two round trips are 34 steps, more than the block's 16), not 13 steps later
    assert sent_at == [21, 2 * BS + 1]
    check_agrees(allocator, on_loop, client)
