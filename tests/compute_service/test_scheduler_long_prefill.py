"""The long-prefill threshold (``long_prefill_token_threshold``): short prompts go first, one a step
beyond the threshold, a long prompt in chunks of it alone and a block beside them, and steps trimmed
to the row counts the model computes as they are (pure Python, no model)."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.engine.scheduler import SchedulerConfig
from kvfleet.compute_service.engine.sequence import Sequence, Status
from kvfleet.core.sampling import SamplingParams
from tests.compute_service.test_scheduler import advance, make_scheduler, seq


def test_a_long_prefill_threshold_leaves_room_for_the_short_prompt_behind_a_long_one():
    sched, _ = make_scheduler(num_blocks=128, budget=256, long_prefill=96)
    sched.add(seq("long", 400))
    sched.add(seq("short", 40, start=1000))
    batch = sched.schedule()                    # the short one first, the long one a block beside it
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("short", 40), ("long", 16)]
    advance(batch)
    batch = sched.schedule()                    # the long one goes on in chunks of 96
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("long", 96)]
    assert [s.seq_id for s in batch.decodes] == ["short"]
    # without it, the long prompt takes the whole budget and the short one waits a step
    sched, _ = make_scheduler(num_blocks=128, budget=256)
    sched.add(seq("long", 400))
    sched.add(seq("short", 40, start=1000))
    assert [(s.seq_id, n) for s, n in sched.schedule().prefills] == [("long", 256)]


def test_a_short_prompt_arriving_mid_document_goes_first_and_the_step_stays_within_the_threshold():
    sched, allocator = make_scheduler(num_blocks=128, budget=256, long_prefill=96)
    long = seq("long", 400)
    sched.add(long)
    advance(sched.schedule())                   # the long one's first chunk of 96
    short = seq("short", 40, start=1000)
    sched.add(short)
    batch = sched.schedule()
    # the short prompt is whole in this step; the long one still advances, one block
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("short", 40), ("long", 16)]
    advance(batch)
    burst = [seq("burst", 90, start=2000), seq("burst2", 90, start=3000)]
    for s in burst:                             # two short prompts past the threshold together:
        sched.add(s)                            # one a step, the first sooner, the second no later
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("burst", 90), ("long", 16)]
    assert [s.seq_id for s in batch.decodes] == ["short"]
    assert burst[1].status is Status.RUNNING and burst[1].num_computed == 0  # admitted: its blocks are held
    advance(batch)
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("burst2", 90), ("long", 16)]
    assert [s.seq_id for s in batch.decodes] == ["short", "burst"]
    advance(batch)
    sched.finish([short, *burst])
    while long.num_computed < 400:              # alone again: chunks of the threshold
        batch = sched.schedule()
        assert sum(n for _, n in batch.prefills) <= 96
        advance(batch)
    assert long.num_computed == 400
    allocator.page_table.check()


def pad_to_32(n):
    """A model that computes rows in multiples of 32 above 16 (cpu_linear's padding, simplified)."""
    return n if n <= 16 else -(-n // 32) * 32


def test_a_long_chunk_is_trimmed_so_that_the_step_computes_no_padding_rows():
    sched, allocator = make_scheduler(num_blocks=128, budget=256, long_prefill=96, step_rows=pad_to_32)
    decoders = [seq(f"d{i}", 20, start=100 * i) for i in range(3)]
    for s in decoders:
        sched.add(s)
    advance(sched.schedule())                   # their prompts, in one step
    long = seq("long", 400, start=1000)
    sched.add(long)
    batch = sched.schedule()                    # 3 decodes + 96 would be 99 rows, computed as 128
    assert [s.seq_id for s in batch.decodes] == ["d0", "d1", "d2"]
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("long", 93)]
    advance(batch)
    short = seq("short", 40, start=5000)        # 3 decodes + 40 + a block = 59, computed as 64:
    sched.add(short)                            # 32 would leave the long one no block, so as it is
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("short", 40), ("long", 16)]
    advance(batch)
    while long.num_computed < 400:              # while it is long, each step computes no padding
        was_long = 400 - long.num_computed > 96
        batch = sched.schedule()
        assert not was_long or pad_to_32(batch.num_tokens) == batch.num_tokens
        advance(batch)
    assert long.num_computed == 400             # trimmed tokens are computed later, none lost
    allocator.page_table.check()


def test_a_long_chunk_is_not_trimmed_below_a_block():
    sched, _ = make_scheduler(num_blocks=128, budget=256, long_prefill=96, step_rows=pad_to_32)
    short = seq("short", 90)
    sched.add(short)
    sched.add(seq("long", 400, start=1000))
    batch = sched.schedule()                    # 90 + a block = 106: trimming 10 would leave 6 tokens
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("short", 90), ("long", 16)]


def test_a_prompt_is_long_or_short_by_what_it_has_left_after_its_cache_hit():
    def turn(seq_id, new_tokens):               # the document's first 96 tokens, then new ones
        return Sequence(seq_id, list(range(96)) + list(range(5000, 5000 + new_tokens)), SamplingParams(max_tokens=100))

    def step():
        batch = sched.schedule()
        advance(batch)
        sched.kv.commit_full_blocks([s for s, _ in batch.prefills] + batch.decodes)  # as the engine does
        return [(s.seq_id, n) for s, n in batch.prefills]

    sched, _ = make_scheduler(num_blocks=128, budget=256, long_prefill=96)
    sched.add(seq("doc", 400))
    step()                                      # its first 96 tokens computed and committed
    sched.add(turn("short", 40))                # 136 tokens, 96 cached: 40 left
    assert step() == [("short", 40), ("doc", 16)]
    sched.add(turn("long", 136))                # 232 tokens, 96 cached: 136 left, a long prompt
    assert step() == [("doc", 96), ("long", 16)]  # the older long prompt goes on; the new one a block


def test_the_long_prefill_threshold_is_not_negative():
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)


def test_a_prompt_sharing_a_deferred_prompts_prefix_waits_for_it_and_finds_it_cached():
    sched, _ = make_scheduler(num_blocks=128, budget=256, long_prefill=96)
    shared = list(range(5000, 5048))                       # three blocks nobody has computed yet
    a, b = seq("a", 60), Sequence("b", shared + list(range(60, 72)), SamplingParams(max_tokens=100))
    c = Sequence("c", shared + list(range(90, 102)), SamplingParams(max_tokens=100))
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()                               # a fits; b (60 more) waits a step, admitted
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("a", 60)]
    assert b.status is Status.RUNNING and c.status is Status.WAITING  # c would compute b's prefix again
    advance(batch)
    sched.kv.commit_full_blocks([a])
    batch = sched.schedule()
    assert [(s.seq_id, n) for s, n in batch.prefills] == [("b", 60)]
    advance(batch)
    sched.kv.commit_full_blocks([b])                       # as the engine does after the step
    sched.schedule()
    assert c.status is Status.RUNNING and c.num_cached_tokens == 48
