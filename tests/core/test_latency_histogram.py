"""The fixed-bucket histogram a service keeps itself, and its Prometheus family."""

from __future__ import annotations

import math

import pytest

from kvfleet.core.latency_histogram import LatencyHistogram
from kvfleet.core.metric_families import histogram, registry_of


def test_observations_land_in_cumulative_buckets_bounds_included():
    h = LatencyHistogram((0.1, 1.0))
    for seconds in (0.05, 0.1, 0.5, 3.0, -0.2):  # a negative reading counts as 0
        h.observe(seconds)
    snap = h.snapshot()
    assert snap.buckets == ((0.1, 3), (1.0, 4), (math.inf, 5))
    assert snap.count == 5 and snap.sum == pytest.approx(3.65)


def test_bounds_must_increase_and_be_positive():
    for bounds in ((), (1.0, 1.0), (0.0, 1.0), (2.0, 1.0)):
        with pytest.raises(ValueError, match="bounds"):
            LatencyHistogram(bounds)


def test_a_snapshot_is_a_prometheus_histogram():
    h = LatencyHistogram((0.5,))
    h.observe(0.2)
    h.observe(0.9)
    r = registry_of([histogram("x_seconds", "x", ("node",), [(("n0",), h.snapshot())])])
    node = {"node": "n0"}
    assert r.get_sample_value("kvfleet:x_seconds_bucket", {**node, "le": "0.5"}) == 1
    assert r.get_sample_value("kvfleet:x_seconds_bucket", {**node, "le": "+Inf"}) == 2
    assert r.get_sample_value("kvfleet:x_seconds_count", node) == 2
    assert r.get_sample_value("kvfleet:x_seconds_sum", node) == pytest.approx(1.1)
