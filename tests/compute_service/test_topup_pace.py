"""Issue 34, the later block boundaries: on a link whose round trip is longer than a few engine
steps, a reserve top-up queued when a sequence crosses a block boundary must go early enough that
its answer is back before the next boundary. The bridge measures its ``ApplyMany`` round trip and
the engine's step on a fake clock here: 0.5 s a round trip, 0.03 s a step.
"""

from __future__ import annotations

import types

from kvfleet.core.block_hash import block_hashes, tenant_extra_key
from tests.compute_service.served_blocks import BS, check_agrees, hashes

ROUND_TRIP_S, STEP_S = 0.5, 0.03


def slow_clock(monkeypatch, client) -> types.SimpleNamespace:
    """The bridge's clock, advanced by hand: each ``ApplyMany`` takes ``ROUND_TRIP_S`` on it."""
    clock = types.SimpleNamespace(now=0.0)
    clock.monotonic = lambda: clock.now
    for module in ("kvfleet.compute_service.blocks.sender", "kvfleet.compute_service.blocks.remote_allocator"):
        monkeypatch.setattr(f"{module}.time", clock, raising=False)
    apply = client.apply

    async def slow_apply(*args, **kwargs):
        clock.now += ROUND_TRIP_S
        return await apply(*args, **kwargs)

    monkeypatch.setattr(client, "apply", slow_apply)
    return clock


def test_on_a_slow_link_the_reserve_covers_two_round_trips_of_decoding_with_one_call_a_block(node, monkeypatch):
    allocator, on_loop, client = node
    clock = slow_clock(monkeypatch, client)
    ids = list(range(20))
    allocator.allocate("a", "t", hashes(ids), 20)             # two blocks and the reserve
    named = block_hashes(ids + list(range(100, 200)), BS, tenant_extra_key("t"))
    last = 20 + 4 * BS
    calls = 0
    for n in range(21, last + 1):                             # decode, a token a step, through 4 boundaries
        allocator.begin_step()
        clock.now += STEP_S
        rpcs = allocator.num_rpcs
        allocator.extend([("a", n)])
        allocator.commit([("a", 0, named[0])] if n == 21 else [])  # urgent: a round trip is measured
        allocator.end_step()
        on_loop(allocator.settle())
        calls += allocator.num_rpcs - rpcs
        [seq] = allocator.live_sequences()
        if n > 23:  # measured (the round trip at 21, the step after it at 22) and topped up (23)
            # two round trips are 34 steps: the blocks held cover them, however the block falls
            assert len(seq.block_ids) * BS >= n + 2 * BS, f"token {n}: {len(seq.block_ids)} blocks"
    assert allocator.num_sync_extends == 0
    assert calls <= 1 + 4 + 1  # the prompt's commit, a top-up a block crossed, the first deeper reserve
    check_agrees(allocator, on_loop, client)
