"""The load generator's pure parts: lengths and mixes, percentiles, the fixed phase's stop rule,
the soak's drift fit, and the tune's block-size search (a made-up objective stands in for the
cluster: the search's logic, not the cluster, is under test)."""

from __future__ import annotations

import math
import random

import pytest

from kvfleet.cli.loadgen.analysis import StopRule, drift, linear_fit
from kvfleet.cli.loadgen.records import PhaseStats, RequestRecord, quantiles, summarize
from kvfleet.cli.loadgen.search import Run, Search, golden_section, log2_grid
from kvfleet.cli.loadgen.workload import Mix, Workload, parse_tokens


def test_token_counts_take_k_suffixes():
    assert [parse_tokens(t) for t in ("512", "8k", "128K", "1.5k")] == [512, 8192, 131072, 1536]
    for bad in ("", "k", "-3", "0", "1.5", "ten"):
        with pytest.raises(ValueError):
            parse_tokens(bad)


def test_mix_normalises_weights_and_scales_lengths():
    mix = Mix.parse("0.2:8k,0.8:128k")
    assert mix.lengths == (8192, 131072) and mix.weights == pytest.approx((0.2, 0.8))
    assert Mix.parse("1:100,3:10").weights == pytest.approx((0.25, 0.75))
    assert mix.scaled(0.01).lengths == (82, 1311)
    assert Mix.single(5).scaled(0.01).lengths == (1,)
    for bad in ("8k", "0:8k", "x:8k", "1:8k,"):
        with pytest.raises(ValueError):
            Mix.parse(bad)


def test_workload_draws_the_mix_in_its_proportions():
    w = Workload(Mix.parse("0.25:3,0.75:7"), max_tokens=2, vocab_size=50, seed=1)
    shapes = [w.next() for _ in range(2000)]
    assert {s.prompt_tokens for s in shapes} == {3, 7}
    assert sum(s.prompt_tokens == 3 for s in shapes) / 2000 == pytest.approx(0.25, abs=0.04)
    assert all(0 <= t < 50 for s in shapes for t in s.prompt)
    assert Workload(Mix.single(4), 1, 50, seed=2).next() == Workload(Mix.single(4), 1, 50, seed=2).next()


def test_quantiles_are_nearest_rank():
    assert quantiles(range(1, 101)) == {"p50": 50, "p90": 90, "p99": 99}
    assert quantiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0}
    assert quantiles([]) == {"p50": None, "p90": None, "p99": None}


def record(status="OK", tokens=4, ttft=0.1, gaps=(0.01,)) -> RequestRecord:
    return RequestRecord("fixed", 1, 10, tokens, sent_at=1.0, status=status, ended_at=2.0, ttft_s=ttft,
                         completion_tokens=tokens if status == "OK" else 1, itl_s=list(gaps))


def test_summary_counts_refusals_by_status_and_tokens_over_wall_time():
    records = [record(), record(), record("RESOURCE_EXHAUSTED"), record("DEADLINE_EXCEEDED")]
    s = summarize(records, wall_s=2.0)
    assert (s.requests, s.completed, s.output_tokens) == (4, 2, 10)
    assert s.tokens_per_s == 5.0 and s.requests_per_s == 1.0
    assert s.refusals == {"RESOURCE_EXHAUSTED": 1, "DEADLINE_EXCEEDED": 1}
    assert s.e2e_s["p50"] == 1.0


def step(tokens_per_s: float, ttft_p99: float, refusals: dict | None = None) -> PhaseStats:
    q = {"p50": ttft_p99, "p90": ttft_p99, "p99": ttft_p99}
    return PhaseStats(10, 10, 1.0, 10, 10, tokens_per_s, 1.0, q, q, q, refusals or {})


def test_fixed_phase_stops_at_refusals_timeouts_or_the_knee():
    rule = StopRule(knee_factor=3, min_gain=0.05)
    assert rule.reason([step(100, 0.1)]) is None
    assert rule.reason([step(100, 0.1), step(150, 0.2)]) is None
    assert rule.reason([step(100, 0.1), step(150, 0.2, {"RESOURCE_EXHAUSTED": 2})]).startswith("refusals")
    assert rule.reason([step(100, 0.1), step(150, 0.2, {"DEADLINE_EXCEEDED": 1})]).startswith("timeouts")
    assert "TTFT" in rule.reason([step(100, 0.1), step(200, 0.31)])
    assert "tokens/s" in rule.reason([step(100, 0.1), step(104, 0.12)])
    with pytest.raises(ValueError):
        StopRule(knee_factor=1)


def test_linear_fit_and_drift_flag_a_rise_not_noise():
    assert linear_fit([0, 1, 2], [1, 3, 5]) == pytest.approx((2.0, 1.0))
    rng = random.Random(0)
    times = [float(t) for t in range(120)]
    steady = drift("rss", times, [500 + rng.uniform(-5, 5) for _ in times])
    rising = drift("rss", times, [500 + 0.5 * t for t in times])
    assert not steady.flagged and rising.flagged
    assert rising.slope_per_min == pytest.approx(30.0)
    pool = drift("blocks", times, [10 + t % 7 for t in times], reference=1000)
    assert not pool.flagged
    assert not drift("x", [], []).flagged


def test_golden_section_brackets_the_peak_of_a_unimodal_grid():
    for n in range(1, 12):
        for peak in range(n):
            lo, hi = golden_section(n, lambda i, j: -abs(i - peak) > -abs(j - peak))
            assert lo <= peak <= hi and hi - lo <= 2, (n, peak, lo, hi)


def fake_cluster(tokens_per_s: dict[int, float], p99_ms: dict[int, float], log: list):
    def measure(block_size: int, stage: str) -> Run:
        log.append((block_size, stage))
        return Run(block_size, stage, tokens_per_s[block_size], p99_ms[block_size], 8, 8)
    return measure


def test_search_measures_each_size_once_then_confirms_the_best_two():
    grid = log2_grid(64, 1024)
    assert grid == [64, 128, 256, 512, 1024]
    speed = {64: 100, 128: 180, 256: 200, 512: 150, 1024: 90}
    log = []
    search = Search(grid, slo_ms=50, measure=fake_cluster(speed, dict.fromkeys(grid, 10.0), log), repeats=2)
    winner = search.run()
    assert winner.block_size == 256
    searched = [b for b, stage in log if stage == "search"]
    assert len(searched) == 2 * len(set(searched)) < 2 * len(grid)  # repeats, memoised, fewer than all
    assert sorted(b for b, stage in log if stage == "confirm") == [128, 256]
    assert len(winner.runs) == 3


def test_search_prefers_sizes_within_the_slo_and_otherwise_the_closest():
    grid = [64, 128, 256]
    speed = {64: 100, 128: 200, 256: 300}
    winner = Search(grid, 50, fake_cluster(speed, {64: 20, 128: 40, 256: 90}, []), confirm=0).run()
    assert winner.block_size == 128  # 256 is faster but misses the SLO
    none_fit = Search(grid, 5, fake_cluster(speed, {64: 20, 128: 40, 256: 90}, []), confirm=0).run()
    assert none_fit.block_size == 64 and not none_fit.within(5)
    nan = Search([64], 5, fake_cluster({64: 0.0}, {64: math.nan}, []), confirm=0).run()
    assert not nan.within(5)


def test_grid_must_be_powers_of_two():
    for low, high in ((48, 1024), (64, 1000), (128, 64)):
        with pytest.raises(ValueError):
            log2_grid(low, high)


def test_phase_plan_refuses_what_cannot_run():
    from kvfleet.cli.loadgen.phases import PhasePlan

    plan = PhasePlan(context=300, mix=Mix.parse("1:100,1:1000"), max_tokens=16, vocab_size=100)
    assert plan.longest_request(("fixed",)) == 316 and plan.longest_request(("fixed", "soak")) == 1016
    for bad in (dict(step=4, max_concurrency=2), dict(max_tokens=0), dict(soak_s=0), dict(concurrency=0)):
        with pytest.raises(ValueError):
            PhasePlan(**{**dict(context=8, mix=Mix.single(8), max_tokens=1, vocab_size=10), **bad})
