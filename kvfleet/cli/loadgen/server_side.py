"""The servers' own figures, read without gRPC: a process's resident memory from /proc, and the
router's Prometheus counters. The bench records them next to its client-side figures, so that the
two can be checked against each other (requests finished, tokens generated).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

# the router's counters (kvfleet/router/metrics.py), summed over tenants and reasons
COUNTERS = {
    "requests_finished": "kvfleet:request_success_total",
    "prompt_tokens": "kvfleet:prompt_tokens_total",
    "generation_tokens": "kvfleet:generation_tokens_total",
}


def rss_mib(pid: int) -> float | None:
    """Resident memory of ``pid`` (``VmRSS`` in /proc/<pid>/status), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


@dataclass(slots=True, frozen=True)
class RouterCounters:
    """Totals since the router started (``minus`` gives a run's share); floats as Prometheus
    keeps them."""

    requests_finished: float
    prompt_tokens: float
    generation_tokens: float

    def minus(self, before: RouterCounters) -> RouterCounters:
        return RouterCounters(self.requests_finished - before.requests_finished,
                              self.prompt_tokens - before.prompt_tokens,
                              self.generation_tokens - before.generation_tokens)


def router_counters(metrics_url: str, timeout_s: float = 10.0) -> RouterCounters:
    """One scrape of the router's /metrics, its request counters summed."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=timeout_s).read().decode()
    sums = dict.fromkeys(COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in sums:
                sums[sample.name] += sample.value
    return RouterCounters(**{key: sums[name] for key, name in COUNTERS.items()})
