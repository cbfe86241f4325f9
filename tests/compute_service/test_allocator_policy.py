"""The remote allocator's policy, without a thread, a loop or a network: what it answers from the
node's tables, what it sends, when, and what block_service's answers change.

Each test plays the bridge's part by hand: ``take``/``take_asks`` stand for a flush, ``fold_*`` for
block_service's answers to it.
"""

from __future__ import annotations

import pytest

from kvfleet.compute_service.blocks.allocator_policy import (
    DEFER_STEPS,
    TOPUP_MARGIN,
    AllocatorPolicy,
    LiveSequence,
)
from kvfleet.core.allocator import DROPPED, AllocateRequest, Allocation, Refusal

BS = 16
H = [bytes([i]) * 16 for i in range(8)]  # stand-ins for block hashes


def refusal(reason: str = "quota") -> Refusal:
    return Refusal(reason, "n0", "t", 1, 4, 4)


def pool_short(blocks: int) -> Refusal:
    """The pool's refusal of an ask ``blocks`` blocks more than it has free."""
    return Refusal("pool", "n0", "t", blocks + 2, 62, 64)


def asked(seq_id: str, num_tokens: int, hashes=(), tenant: str = "t") -> AllocateRequest:
    return AllocateRequest("n0", seq_id, tenant, list(hashes), num_tokens)


def claimed(num_tokens: int, block_ids: list[int], seq_id: str = "s") -> AllocatorPolicy:
    """A policy whose engine holds ``seq_id`` (asked synchronously), its reserve top-up queued."""
    policy = AllocatorPolicy(BS)
    policy.claim(seq_id, "t", Allocation(list(block_ids), 0), num_tokens)
    return policy


def steps_until_sent(policy: AllocatorPolicy, limit: int = 100) -> int:
    """End steps until the policy says what is queued must go; how many it took."""
    for n in range(1, limit + 1):
        if policy.end_step():
            return n
    raise AssertionError(f"nothing became due within {limit} steps")


def test_preallocations_of_one_loop_iteration_go_together_and_the_match_is_claimed():
    policy = AllocatorPolicy(BS)
    assert policy.ask(asked("a", 40, H[:2])) is True      # the first queued: the bridge kicks a send
    assert policy.ask(asked("b", 20, H[:1])) is False     # rides along
    asks = policy.take_asks()
    assert [r.seq_id for r in asks] == ["a", "b"] and policy.take_asks() == []
    assert [r.num_tokens for r in asks] == [4 * BS, 3 * BS]  # each through its reserve block
    policy.fold_asks(asks, [Allocation([0, 1, 2, 3], 0), refusal("unavailable")])
    assert policy.live_sequences() == [LiveSequence("a", "t", [0, 1, 2, 3], 4 * BS)]
    assert policy.allocate("b", H[:1], 20) is None        # refused early: the engine asks itself
    got = policy.allocate("a", H[:2], 40)
    assert got == Allocation([0, 1, 2], 0)                # the reserve is not the engine's yet
    assert not policy.has_bookkeeping()                   # it came with the grant: no top-up
    assert policy.live_sequences() == [LiveSequence("a", "t", [0, 1, 2, 3], 4 * BS)]


def test_a_prompt_filling_its_blocks_decodes_its_first_token_into_the_reserve_it_was_granted_with():
    """Issue 34: a prompt of whole blocks needs a new block at its first decoded token. Its reserve
    came as a top-up sent after the step, behind the prompt's commits, so that token found none
    and the engine asked block_service on its step (8-77 ms on a LAN, 1.5-2.2 s on the lossy soak).
    The first allocation carries the reserve now, early or asked by the engine itself."""
    policy = AllocatorPolicy(BS)
    policy.ask(asked("e", 32, H[:1]))                     # two full blocks (the last one recomputed)
    asks = policy.take_asks()
    assert asks == [asked("e", 3 * BS, H[:1])]
    policy.fold_asks(asks, [Allocation([0, 1, 2], 1)])
    assert policy.allocate("e", H[:1], 32) == Allocation([0, 1], 1)
    assert policy.first.ask_tokens(H[:1], 32) == 3 * BS         # the engine's own ask, granted as block_service does
    assert policy.claim("s", "t", Allocation([5, 6, 7], 0), 32, 3 * BS) == Allocation([5, 6], 0)
    assert not policy.has_bookkeeping()                   # no top-up queued for either
    grown = policy.extend([("e", 33), ("s", 33)])
    assert grown.short == [] and grown.answers == {"e": [2], "s": [7]}
    assert policy.take().topups == [("e", 4 * BS), ("s", 4 * BS)]  # the next reserves, write-behind
    assert policy.live_sequences() == [LiveSequence("e", "t", [0, 1, 2], 3 * BS),
                                       LiveSequence("s", "t", [5, 6, 7], 3 * BS)]


def test_no_reserve_past_max_model_len_nor_for_a_chain_whose_every_block_is_named():
    policy = AllocatorPolicy(BS)
    assert policy.first.ask_tokens([], 20) == 3 * BS
    assert policy.first.ask_tokens(H[:2], 32) == 32             # an imported chain: nothing left to compute
    policy.cap_length(64)
    assert policy.first.ask_tokens([], 64) == 64                # a contiguous reservation: max_model_len already
    assert policy.first.ask_tokens(H[:3], 64) == 64
    assert policy.first.ask_tokens([], 50) == 50                # its blocks hold every token it may reach
    assert policy.first.ask_tokens([], 40) == 64                # the last block it may need is its reserve
    policy.ask(asked("c", 64))
    assert policy.take_asks() == [asked("c", 64)]


def test_an_ask_refused_for_its_reserve_is_asked_again_without_it():
    """A reserve never costs an admission: refused for the pool or the tenant's quota, the blocks
    alone are asked for at once; the reserve then comes as a top-up, when it fits."""
    policy = AllocatorPolicy(BS)
    for seq_id in ("q", "p", "u", "g", "f"):
        policy.ask(asked(seq_id, 40, H[:2]))
    asks = policy.take_asks()
    results = [refusal("quota"), pool_short(1), refusal("unavailable"), Allocation([0, 1, 2, 3], 0), pool_short(3)]
    again = policy.first.asks_again(asks, results)
    assert again == [(0, asked("q", 40, H[:2])), (1, asked("p", 40, H[:2]))]
    assert policy.first.asks_again([r for _, r in again], [refusal("quota"), refusal("quota")]) == []  # refused still
    for i, request in again:                              # the bridge puts them in place
        asks[i] = request
    results[:2] = [Allocation([4, 5, 6], 0), refusal("quota")]
    policy.fold_asks(asks, results)
    assert [(s.seq_id, s.num_tokens) for s in policy.live_sequences()] == [("q", 40), ("g", 4 * BS)]
    assert policy.allocate("q", H[:2], 40) == Allocation([4, 5, 6], 0)  # granted without: it fits
    assert policy.take().topups == [("q", 4 * BS)]        # and its reserve is topped up, as before
    # the engine's own ask: the same decision
    assert policy.first.without_reserve(40, 4 * BS, refusal("quota")) == 40
    assert policy.first.without_reserve(40, 4 * BS, pool_short(1)) == 40
    assert policy.first.without_reserve(40, 4 * BS, refusal("unavailable")) is None
    assert policy.first.without_reserve(40, 40, refusal("quota")) is None  # asked without: the refusal stands
    # short by more than the reserve: the blocks alone would be refused too (a sequence waiting for
    # a full pool asks once a step, not twice)
    assert policy.first.without_reserve(40, 4 * BS, pool_short(2)) is None
    assert policy.first.without_reserve(40, 4 * BS, Refusal("quota", "n0", "t", 4, 2, 4)) is None


def test_an_early_allocation_asked_differently_is_given_back():
    policy = AllocatorPolicy(BS)
    policy.ask(asked("a", 40, H[:2]))
    asks = policy.take_asks()
    policy.fold_asks(asks, [Allocation([0, 1, 2], 0)])
    assert policy.allocate("a", H[:1], 30) is None        # the engine hashed differently
    assert policy.live_sequences() == []
    assert policy.end_step() is True                      # a release is urgent
    assert policy.take().releases == ["a"]


def test_the_reserve_is_handed_over_and_topped_up_one_block_ahead():
    policy = claimed(40, [0, 1, 2])
    batch = policy.take()
    assert batch.topups == [("s", 64)]
    policy.fold_topups(batch.topups, [[3]])
    assert policy.live_sequences() == [LiveSequence("s", "t", [0, 1, 2, 3], 64)]
    grown = policy.extend([("s", 48)])
    assert grown.answers == {"s": []} and grown.short == []
    assert not policy.has_bookkeeping()                   # the reserve is still there
    grown = policy.extend([("s", 49)])
    assert grown.answers == {"s": [3]} and grown.short == []  # the reserve, no call
    assert policy.take().topups == [("s", 80)]            # and the next one is asked for


def test_a_topup_is_due_a_margin_before_decoding_could_need_it():
    policy = claimed(20, [0, 1])                          # 12 free slots in its 2 blocks
    assert steps_until_sent(policy) == 32 - 20 - TOPUP_MARGIN + 1
    policy = claimed(32, [0, 1])                          # full: the reserve goes with this step
    assert steps_until_sent(policy) == 1


def test_a_prompt_blocks_commit_is_urgent_a_generated_blocks_waits_for_company():
    policy = claimed(40, [0, 1, 2])                       # prompt: 2 full blocks
    policy.fold_topups(*_sent(policy, [[3]]))
    policy.commit([("s", 0, H[0]), ("s", 1, H[1])])
    assert policy.end_step() is True
    assert policy.take().commits == [("s", 0, H[0]), ("s", 1, H[1])]
    policy.commit([("s", 2, H[2])])                       # a generated block
    assert steps_until_sent(policy) == DEFER_STEPS + 1
    assert policy.take().commits == [("s", 2, H[2])]
    policy.commit([])
    assert not policy.has_bookkeeping()


def test_a_release_is_urgent_and_drops_the_sequences_queued_topup():
    policy = claimed(40, [0, 1, 2])
    policy.begin_step()
    assert policy.release(["s"]) is False                 # during a step: end_step sends it
    assert policy.end_step() is True
    batch = policy.take()
    assert (batch.releases, batch.topups) == (["s"], [])
    assert policy.live_sequences() == []
    assert claimed(40, [0, 1, 2]).release(["s"]) is True  # between steps (an abort): send now


def test_a_drop_marks_the_table_at_once_and_goes_with_the_deferred_bookkeeping():
    """Sliding window: the table the node would sync shows the drop before block_service hears it;
    the drop waits like a generated block's commit and goes after it in the same batch."""
    policy = claimed(50, [0, 1, 2, 3])                    # prompt: 3 full blocks
    policy.take()
    policy.commit([("s", 3, H[3])])                       # a generated block
    policy.drop_front([("s", 2)])
    policy.drop_front([("s", 3)])
    assert policy.live_sequences()[0].block_ids == (DROPPED, DROPPED, DROPPED, 3)
    assert steps_until_sent(policy) == DEFER_STEPS + 1
    batch = policy.take()
    assert (batch.commits, batch.drops) == ([("s", 3, H[3])], [("s", 3)])
    policy.requeue(batch)                                 # not delivered: sent again, once
    assert policy.take().drops == [("s", 3)]
    policy.drop_front([("s", 4)])
    policy.release(["s"])
    assert policy.take().drops == []                      # the release gives back the whole table


def test_without_a_reserve_extend_asks_one_block_ahead_then_exactly():
    policy = claimed(32, [0, 1])
    policy.fold_topups(*_sent(policy, [refusal()]))      # the reserve was refused
    grown = policy.extend([("s", 33)])
    assert grown.answers == {} and grown.short == [("s", 33)]
    asks = policy.extend_asks(grown.short)
    assert asks == [("s", 64)]                            # one block ahead of the 3 it needs
    retry = policy.fold_extend(asks, [refusal()])
    assert retry == [("s", 33)]                           # refused: exactly what the engine needs
    assert policy.fold_extend(retry, [[2]]) == []
    assert policy.hand_over() == {"s": [2]}
    assert policy.live_sequences() == [LiveSequence("s", "t", [0, 1, 2], 33)]


def test_a_refused_exact_extend_is_the_engines_answer():
    policy = claimed(32, [0, 1])
    policy.fold_topups(*_sent(policy, [refusal()]))
    short = policy.extend([("s", 33)]).short
    retry = policy.fold_extend(policy.extend_asks(short), [refusal()])
    assert policy.fold_extend(retry, [refusal("pool")]) == []
    assert policy.hand_over() == {"s": refusal("pool")}
    assert policy.live_sequences() == [LiveSequence("s", "t", [0, 1], 32)]  # unchanged


def test_a_granted_ahead_extend_leaves_a_reserve():
    policy = claimed(32, [0, 1])
    policy.fold_topups(*_sent(policy, [refusal()]))
    short = policy.extend([("s", 33)]).short
    asks = policy.extend_asks(short)
    assert policy.fold_extend(asks, [[2, 3]]) == []
    assert policy.hand_over() == {"s": [2]}
    assert policy.extend([("s", 49)]).answers == {"s": [3]}  # the block ahead


def test_a_request_ending_gives_back_only_what_the_engine_never_claimed():
    policy = AllocatorPolicy(BS)
    policy.ask(asked("a", 20, H[:1]))
    policy.ask(asked("b", 20, H[:1]))
    asks = policy.take_asks()
    policy.fold_asks(asks, [Allocation([0, 1], 0), Allocation([2, 3], 0)])
    policy.allocate("a", H[:1], 20)
    policy.take()
    assert policy.release_unclaimed(["a", "b"]) is True  # the engine holds a: its release is the engine's
    assert policy.take().releases == ["b"]
    assert [s.seq_id for s in policy.live_sequences()] == ["a"]
    assert policy.release(["b", "unknown"]) is False      # already released, never known: nothing to send
    assert not policy.has_bookkeeping()
    assert policy.release(["a"]) is True                  # the engine's own release
    assert policy.take().releases == ["a"] and policy.live_sequences() == []


class QuotaBlockService:
    """block_service's extend, for one tenant: each sequence's length and blocks, a block quota,
    and its refusal to shrink a sequence (an error, which killed the node's step thread)."""

    def __init__(self, quota: int, held: dict[str, tuple[int, int]]):
        self.quota = quota
        self.held = dict(held)  # seq → (tokens, blocks)
        self.next_block = 1000

    def extend(self, asks: list[tuple[str, int]]) -> list[list[int] | Refusal]:
        results: list[list[int] | Refusal] = []
        for seq_id, tokens in asks:
            length, blocks = self.held[seq_id]
            assert tokens >= length, f"sequence {seq_id!r} holds {length} tokens; extend cannot shrink it to {tokens}"
            more = max(-(-tokens // BS) - blocks, 0)
            if sum(b for _, b in self.held.values()) + more > self.quota:
                results.append(refusal())
                continue
            self.held[seq_id] = (tokens, blocks + more)
            results.append(list(range(self.next_block, self.next_block + more)))
            self.next_block += more
        return results


def extend_as_the_bridge_does(policy: AllocatorPolicy, short, block_service: QuotaBlockService):
    asks = policy.extend_asks(short)
    while asks:
        asks = policy.fold_extend(asks, block_service.extend(asks))
    return policy.hand_over()


def test_an_extend_never_asks_to_shrink_what_a_topup_just_granted():
    """A tenant near its quota killed nodes with "holds 512 tokens; extend cannot shrink
    it to 497". The engine crossed into block 32 while the reserve's top-up (to 512 tokens) was
    still queued; the bridge sent the queue first (granted), then asked one block ahead (refused:
    the quota), then exactly 497 tokens: less than block_service had just granted."""
    policy = claimed(496, list(range(31)))                # its top-up to 512 tokens is queued
    short = policy.extend([("s", 497)]).short
    assert short == [("s", 497)]
    block_service = QuotaBlockService(quota=32, held={"s": (496, 31)})
    topups, _ = _sent(policy, [])                         # the queue goes first: the top-up is granted
    policy.fold_topups(topups, block_service.extend(topups))
    assert extend_as_the_bridge_does(policy, short, block_service) == {"s": [1000]}
    assert policy.live_sequences() == [LiveSequence("s", "t", list(range(31)) + [1000], 512)]


@pytest.mark.parametrize("moment", ["queued", "in flight", "answered", "claimed"])
def test_a_request_ended_at_any_moment_leaves_block_service_holding_nothing(moment):
    """Requests cancelled in their first ~100 ms kept their early allocation: the
    request's release came while its ask was still queued or in flight, found nothing granted yet,
    and the answer landed afterwards for nobody to claim. ``holds`` is what block_service holds."""
    policy = AllocatorPolicy(BS)
    holds: set[str] = set()

    def flush():
        batch = policy.take()
        holds.difference_update(batch.releases)

    policy.ask(asked("a", 20, H[:1]))
    if moment == "queued":
        policy.release_unclaimed(["a"])
    asks = policy.take_asks()
    if moment == "in flight":
        assert policy.release_unclaimed(["a"]) is False  # nothing to send yet: the answer is not in
    holds.update(r.seq_id for r in asks)
    if policy.fold_asks(asks, [Allocation([0, 1], 0) for _ in asks]):
        flush()
    if moment == "claimed":
        assert policy.allocate("a", H[:1], 20) == Allocation([0, 1], 0)
    if moment in ("answered", "claimed"):
        policy.release_unclaimed(["a"])              # the request's stream ended
    if moment == "claimed":
        flush()
        assert holds == {"a"}                             # the engine may be mid-step on it: its own
        policy.release(["a"])                             # the engine's release, when the abort lands
    flush()
    assert holds == set() and policy.live_sequences() == []
    assert not policy.has_bookkeeping() and policy.take_asks() == []


def _sent(policy: AllocatorPolicy, results):
    """Take what is queued as a flush would; (the batch's top-ups, ``results``) to fold."""
    return policy.take().topups, results


def test_a_commit_past_the_length_grows_it_as_block_service_does():
    """The reserve top-up was refused, so block_service's length stayed at the prompt's 40 tokens;
    the engine filled block 2 and commits it. block_service grows the length to 48 (the commit
    declares its block full); the node's account must say the same, or its next sync would list
    the sequence shorter than block_service holds it."""
    policy = claimed(40, [0, 1, 2])
    policy.fold_topups(*_sent(policy, [refusal()]))
    policy.commit([("s", 2, H[2])])
    batch, live = policy.take_for_sync()                 # not sent yet: block_service has 40
    assert live == [LiveSequence("s", "t", [0, 1, 2], 40)]
    resend = policy.after_sync(batch, [])
    assert resend.commits == [("s", 2, H[2])]            # still sent after a sync
    policy.fold_commits(resend.commits, refused=())
    assert policy.live_sequences() == [LiveSequence("s", "t", [0, 1, 2], 3 * BS)]

    policy = claimed(40, [0, 1, 2])
    policy.fold_topups(*_sent(policy, [refusal()]))
    policy.commit([("s", 2, H[2])])
    policy.fold_commits(policy.take().commits, refused={0})  # refused: nothing changes
    assert policy.live_sequences() == [LiveSequence("s", "t", [0, 1, 2], 40)]


def test_early_grants_give_way_to_the_sequence_the_pool_refused_newest_first():
    policy = AllocatorPolicy(BS)
    for seq_id, hashes in (("head", H[:2]), ("b", H[2:4]), ("c", H[4:6]), ("d", H[6:8])):
        policy.ask(asked(seq_id, 40, hashes))
    asks = policy.take_asks()
    policy.fold_asks(asks, [Allocation([0, 1, 2], 0), Allocation([3, 4, 5], 1), Allocation([6, 7, 8], 0),
                            Allocation([9, 10, 11], 0)])
    assert policy.allocate("head", H[:3], 50) is None     # asked differently: given back, asked now
    # refused for the pool, 4 blocks short: d's and c's new blocks (3 + 3) cover it; b keeps its hit
    assert policy.give_back_early("head", pool_short(4)) == ["d", "c"]
    assert policy.take().releases == ["head", "d", "c"]
    assert [s.seq_id for s in policy.live_sequences()] == ["b"]
    assert policy.give_back_early("head", refusal("quota")) == []  # the tenant's answer: nothing to gain
    assert policy.give_back_early("head", pool_short(9)) == ["b"]  # still short: the rest goes too
    assert policy.give_back_early("head", pool_short(9)) == []     # nothing more to give: no retry


def test_grants_carrying_their_reserve_fit_and_give_way_with_it():
    """A grant holds its reserve until claimed: given back, it frees that block too."""
    policy = AllocatorPolicy(BS)
    for seq_id, hashes in (("head", []), ("b", H[2:4]), ("c", H[4:6])):
        policy.ask(asked(seq_id, 40, hashes))
    policy.fold_asks(policy.take_asks(), [refusal("pool"), Allocation([3, 4, 5, 6], 1), Allocation([7, 8, 9, 10], 0)])
    # 4 blocks short: c's four (its reserve with them) cover it; b keeps its hit
    assert policy.give_back_early("head", pool_short(4)) == ["c"]
    assert policy.allocate("b", H[2:4], 40) == Allocation([3, 4, 5], 1)
    assert policy.take().releases == ["c"]
    assert policy.live_sequences() == [LiveSequence("b", "t", [3, 4, 5, 6], 4 * BS)]
