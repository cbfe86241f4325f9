"""The report's bootstrap: a real difference earns a verdict, the same distribution earns none, seeded."""

from __future__ import annotations

import numpy as np

from kvfleet.cli.canary_verdict import BETTER, SAME, TOO_FEW, WORSE, GroupData, compare, groups_from_samples
from kvfleet.core.groups import CANARY, STABLE


def _outcomes(rng, n: int, ttft_s: float, itl_s: float, errors: int = 0, cached: int = 0) -> list[dict]:
    rows = []
    for i in range(n):
        gaps = list(rng.gamma(8.0, itl_s / 8.0, size=16))
        rows.append({"group": "x", "started_at": float(i), "ended_at": float(i) + 1.0,
                     "ttft_s": float(rng.gamma(8.0, ttft_s / 8.0)), "gaps_s": gaps, "prompt_tokens": 64,
                     "cached_tokens": cached, "completion_tokens": 17, "error": "UNAVAILABLE" if i < errors else ""})
    return rows


def _verdicts(canary_rows, stable_rows, seed=0):
    c, s = GroupData.of(canary_rows, 100.0, 1), GroupData.of(stable_rows, 100.0, 2)
    return {v.metric: v for v in compare(c, s, resamples=300, seed=seed)}


def test_a_much_slower_first_token_is_worse_and_nothing_else_is_called() -> None:
    rng = np.random.default_rng(1)
    got = _verdicts(_outcomes(rng, 200, 0.30, 0.02), _outcomes(rng, 400, 0.05, 0.02))
    assert got["ttft_p50_s"].verdict == WORSE and got["ttft_p50_s"].difference > 3
    assert got["itl_p50_s"].verdict == SAME and got["error_rate"].verdict == SAME


def test_the_same_distribution_gives_no_verdict_on_any_metric_over_seeds() -> None:
    for seed in range(3):
        rng = np.random.default_rng(100 + seed)
        got = _verdicts(_outcomes(rng, 150, 0.05, 0.02), _outcomes(rng, 300, 0.05, 0.02), seed=seed)
        assert {v.metric: v.verdict for v in got.values() if v.verdict != SAME} == {}


def test_better_cache_hits_and_fewer_errors_are_better_and_the_result_is_seeded() -> None:
    rng = np.random.default_rng(3)
    canary, stable = _outcomes(rng, 200, 0.05, 0.02, cached=48), _outcomes(rng, 200, 0.05, 0.02, errors=20)
    got = _verdicts(canary, stable)
    assert got["prefix_hit_rate"].verdict == BETTER and got["error_rate"].verdict == BETTER
    assert _verdicts(canary, stable)["ttft_p99_s"].difference_interval == got["ttft_p99_s"].difference_interval


def test_too_few_requests_earn_no_verdict() -> None:
    rng = np.random.default_rng(4)
    got = _verdicts(_outcomes(rng, 5, 1.0, 0.02), _outcomes(rng, 300, 0.05, 0.02))
    assert {v.verdict for v in got.values()} == {TOO_FEW}


def test_replicas_samples_merge_over_one_window_with_each_side_s_nodes() -> None:
    rng = np.random.default_rng(5)
    one = {"groups": {CANARY: _outcomes(rng, 3, 0.1, 0.01)}, "ready_nodes": {CANARY: 1, STABLE: 2},
           "split": {"share": 0.33}}
    two = {"groups": {STABLE: _outcomes(rng, 4, 0.1, 0.01)}, "ready_nodes": {STABLE: 2}, "split": None}
    groups, info = groups_from_samples([two, one])
    assert (groups[CANARY].num_requests, groups[STABLE].num_requests) == (3, 4)
    assert (groups[STABLE].nodes, groups[STABLE].window_s, info["split"]) == (2, 4.0, {"share": 0.33})


def test_the_luck_of_the_split_is_not_a_throughput_difference() -> None:
    rng = np.random.default_rng(6)
    # the same per-node rate, the canary dealt 13% fewer conversations than its share
    got = _verdicts(_outcomes(rng, 130, 0.05, 0.02), _outcomes(rng, 300, 0.05, 0.02))
    assert got["tokens_per_s_per_node"].verdict == SAME
    halved = [dict(o, completion_tokens=o["completion_tokens"] // 2) for o in _outcomes(rng, 150, 0.05, 0.02)]
    assert _verdicts(halved, _outcomes(rng, 300, 0.05, 0.02))["tokens_per_s_per_node"].verdict == WORSE
