"""Building Prometheus metric families from rows of figures: the vocabulary the services' pure
metrics modules (``*/metrics.py``) map their stats objects with.

A family is built fresh at every scrape from a sample of the service's own counters, so a counter
here is a running total the service already keeps, never one this module increments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from kvfleet.core.latency_histogram import HistogramSnapshot

PREFIX = "kvfleet:"

Rows = Iterable[tuple[Sequence[str], float]]  # (label values, value)


def gauge(name: str, doc: str, labels: Sequence[str], rows: Rows) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


def counter(name: str, doc: str, labels: Sequence[str], rows: Rows) -> CounterMetricFamily:
    """``name`` without ``_total``: prometheus_client adds it to the exposed sample."""
    family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))
    for values, value in rows:
        family.add_metric(list(values), value)
    return family


def histogram(name: str, doc: str, labels: Sequence[str],
              rows: Iterable[tuple[Sequence[str], HistogramSnapshot]]) -> HistogramMetricFamily:
    """From ``LatencyHistogram`` snapshots (cumulative buckets, the last ``+Inf``)."""
    family = HistogramMetricFamily(PREFIX + name, doc, labels=list(labels))
    for values, snap in rows:
        buckets = [("+Inf" if bound == float("inf") else repr(bound), n) for bound, n in snap.buckets]
        family.add_metric(list(values), buckets, snap.sum)
    return family


def registry_of(families: Iterable[Metric]) -> CollectorRegistry:
    """A registry that serves these families (once built): one sample's figures, readable with
    ``get_sample_value`` or ``generate_latest`` — for a one-off dump and for tests of the mappings."""
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families)))
    return registry


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
