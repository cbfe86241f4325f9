"""The router's per-group outcomes: what one request's chunks make, the ring's bound, a new split's reset."""

from __future__ import annotations

import pytest

from kvfleet.core.canary import SPLIT, CanarySplit
from kvfleet.router.canary_samples import MAX_GAPS, GroupSamples, Outcome, OutcomeTimer
from kvfleet.router.canary_watch import CanaryRouting


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_request_s_chunks_make_its_ttft_gaps_and_usage() -> None:
    clock = Clock()
    timer = OutcomeTimer("canary", clock)
    clock.now += 0.5
    timer.chunk(1)
    clock.now += 0.2
    timer.chunk(2)  # two tokens in one chunk: two gaps of 0.1
    clock.now += 0.1
    timer.chunk(0, (10, 4, 3))
    o = timer.done()
    assert (o.group, o.ttft_s) == ("canary", 0.5) and o.gaps_s == pytest.approx((0.1, 0.1))
    assert (o.prompt_tokens, o.cached_tokens, o.completion_tokens, o.error) == (10, 4, 3, "")
    assert Outcome.from_dict(o.to_dict()).gaps_s == pytest.approx(o.gaps_s)


def test_gaps_are_bounded_per_request_and_outcomes_per_group() -> None:
    clock = Clock()
    timer = OutcomeTimer("stable", clock)
    for _ in range(MAX_GAPS + 10):
        clock.now += 0.01
        timer.chunk(1)
    assert len(timer.done().gaps_s) == MAX_GAPS
    ring = GroupSamples(capacity=3)
    for i in range(5):
        ring.add(Outcome("stable", i, i, None))
    ring.add(Outcome("canary", 0, 0, None, error="UNAVAILABLE"))
    data = ring.to_json()["groups"]
    assert [o["started_at"] for o in data["stable"]] == [2, 3, 4]
    assert data["canary"][0]["error"] == "UNAVAILABLE"


def test_the_split_follows_etcd_values_and_a_new_split_starts_a_new_comparison() -> None:
    canary = CanaryRouting()
    canary.apply(SPLIT, CanarySplit(0.5, started_at=1.0).to_json())
    canary.record(Outcome("canary", 0, 0, None))
    canary.apply(SPLIT, CanarySplit(0.7, started_at=1.0).to_json())  # the share changed, same comparison
    assert canary.split.share == 0.7 and canary.samples.by_group
    canary.apply(SPLIT, b"not json")  # kept as it was
    assert canary.split.share == 0.7
    canary.apply(SPLIT, CanarySplit(0.1, started_at=2.0).to_json())
    assert not canary.samples.by_group
    canary.apply(SPLIT, None)
    assert canary.split is None
    canary.record(Outcome("stable", 0, 0, None))  # no comparison under way: nothing kept (the ring stays empty)
    assert not canary.samples.by_group
    body = canary.samples_json(["stable", "blue", "canary"])
    assert body["ready_nodes"] == {"stable": 2, "canary": 1} and body["split"] is None
