"""The split's pure assignment: the share within statistical bounds, sticky, monotone, per tenant."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from kvfleet.core.canary import CanarySplit, check_share
from kvfleet.core.groups import CANARY, STABLE
from kvfleet.router.canary_split import KEY_TOKENS, assign, conversation_key, in_group

N = 20000


def _keys(n: int = N) -> list[bytes]:
    rng = random.Random(7)
    return [conversation_key(prompt_ids=[rng.randrange(50000) for _ in range(12)]) for _ in range(n)]


@pytest.mark.parametrize("share", [0.01, 0.1, 0.33, 0.5, 0.9])
def test_the_canary_gets_its_share_within_five_standard_deviations(share: float) -> None:
    split = CanarySplit(share)
    got = sum(assign(split, "gold", k) == CANARY for k in _keys()) / N
    assert abs(got - share) < 5 * math.sqrt(share * (1 - share) / N)


def test_share_zero_and_one_are_exact_and_no_split_is_all_stable() -> None:
    keys = _keys(2000)
    assert {assign(CanarySplit(0.0), "t", k) for k in keys} == {STABLE}
    assert {assign(CanarySplit(1.0), "t", k) for k in keys} == {CANARY}
    assert {assign(None, "t", k) for k in keys} == {STABLE}


def test_a_conversation_is_sticky_and_raising_the_share_moves_only_new_ones() -> None:
    keys = _keys(5000)
    low, high = CanarySplit(0.1), CanarySplit(0.2)
    first = [assign(low, "t", k) for k in keys]
    assert first == [assign(low, "t", k) for k in keys]  # the same key, the same group, every time
    assert all(assign(high, "t", k) == CANARY for k, g in zip(keys, first) if g == CANARY)


def test_the_tenant_filter_keeps_other_tenants_on_stable_and_tenants_draw_independently() -> None:
    keys = _keys(5000)
    split = CanarySplit(0.5, tenant="gold")
    assert {assign(split, "free", k) for k in keys} == {STABLE}
    gold = [assign(CanarySplit(0.5), "gold", k) for k in keys]
    free = [assign(CanarySplit(0.5), "free", k) for k in keys]
    agree = sum(a == b for a, b in zip(gold, free)) / len(keys)
    assert 0.45 < agree < 0.55  # independent draws agree half the time


def test_the_conversation_key_is_the_explicit_id_else_the_chat_head_else_the_first_tokens() -> None:
    assert conversation_key("conv-1", [("user", "a")], [1, 2]) == conversation_key("conv-1")
    turn1 = [("system", "s"), ("user", "hello")]
    turn2 = [*turn1, ("assistant", "hi"), ("user", "more")]
    assert conversation_key(chat=turn1) == conversation_key(chat=turn2)
    assert conversation_key(chat=turn1) != conversation_key(chat=[("system", "s"), ("user", "bye")])
    long = list(range(KEY_TOKENS + 50))
    assert conversation_key(prompt_ids=long) == conversation_key(prompt_ids=long[:KEY_TOKENS] + [7])
    assert conversation_key(prompt_ids=[1, 2]) != conversation_key(prompt_ids=[1, 3])


def test_routing_stays_inside_the_side_unless_the_side_has_no_node() -> None:
    nodes = [SimpleNamespace(info=SimpleNamespace(group=g)) for g in ("stable", "blue", "canary")]
    assert [n.info.group for n in in_group(nodes, CANARY)] == ["canary"]
    assert [n.info.group for n in in_group(nodes, STABLE)] == ["stable", "blue"]
    assert in_group(nodes[:2], CANARY) == nodes[:2]  # no canary node READY: the stable side serves


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "x", None])
def test_a_share_outside_zero_one_is_refused_in_one_line(bad) -> None:
    with pytest.raises(ValueError, match="share must be") as err:
        check_share(bad)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError):
        CanarySplit(bad)


def test_the_split_round_trips_through_json() -> None:
    split = CanarySplit(0.25, "gold", 12.5, "canary.yaml", "batch_wait_ms: 50\n", "")
    assert CanarySplit.from_json(split.to_json()) == split
    with pytest.raises(ValueError):
        CanarySplit.from_json(b"[1, 2]")
