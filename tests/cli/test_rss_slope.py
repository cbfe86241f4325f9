"""The memory slope (issue 35): MiB per hour from a fit after the warm-up, pure."""

from __future__ import annotations

import random

import pytest

from kvfleet.cli.loadgen.rss_slope import MIN_SAMPLES, Slope, fit_after, rss_slope, worst


def series(mib_at, seconds: int = 1800, every: int = 30, pid: int = 7) -> list[tuple[float, int, float]]:
    return [(float(t), pid, mib_at(t)) for t in range(0, seconds + 1, every)]


def test_a_flat_series_has_no_slope_even_with_noise():
    rng = random.Random(3)
    slope = rss_slope(series(lambda t: 540 + rng.uniform(-0.5, 0.5)), warmup_s=120)
    assert abs(slope.mib_per_hour) < 2
    assert slope.samples == 57 and slope.span_s == 1680 and not slope.reason


def test_a_linear_series_gives_its_slope_and_the_warmup_is_left_out():
    # steep growth in the first two minutes (the warm-up), then 95 MiB an hour (issue 35's nodes)
    def mib(t):
        return 500 + 0.5 * min(t, 120) + 95 * max(t - 120, 0) / 3600

    assert rss_slope(series(mib), warmup_s=120).mib_per_hour == pytest.approx(95)
    assert rss_slope(series(mib), warmup_s=0).mib_per_hour > 115  # the warm-up fitted too: not its slope


def test_too_few_samples_give_none_with_the_reason():
    slope = rss_slope(series(lambda t: 500 + t, seconds=150), warmup_s=120)  # samples at 120 and 150
    assert slope == Slope(None, 2, 0.0, f"2 samples after the warm-up, {MIN_SAMPLES} needed")
    assert rss_slope([], warmup_s=0).reason == "no samples"
    assert fit_after([(5.0, 1.0)] * 4, 0).reason == "the samples after the warm-up share one time"


def test_samples_a_process_could_not_be_read_are_left_out():
    points = [(0.0, 100.0), (60.0, None), (120.0, 102.0), (180.0, None), (240.0, 104.0)]
    assert fit_after(points, 0).mib_per_hour == pytest.approx(60) and fit_after(points, 0).samples == 3


def test_a_restarted_process_is_fitted_from_its_own_warmup():
    before = series(lambda t: 500 + t, seconds=600, pid=41)           # fast growth, then killed
    after = [(t + 630, 97, 400 + (0.3 * t if t < 120 else 36 + 10 * (t - 120) / 3600))
             for t, _, _ in series(lambda t: 0, seconds=600)]
    slope = rss_slope(before + after, warmup_s=120)
    assert slope.mib_per_hour == pytest.approx(10)
    assert slope.samples == 17  # 750 s to 1230 s


def test_the_worst_is_the_steepest_fitted_slope():
    slopes = {"node-0": Slope(3.0, 10, 600), "router": Slope(37.0, 10, 600), "etcd": Slope(None, 1, 0, "why")}
    assert worst(slopes) == ("router", 37.0)
    assert worst({"etcd": Slope(None, 1, 0, "why")}) is None
