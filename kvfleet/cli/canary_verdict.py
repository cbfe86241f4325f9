"""``kvfleet canary report``'s statistics: per group, each metric with a bootstrap confidence
interval, and per metric a verdict on the canary against the stable group. Pure (numpy), seeded.

    metric            per group                                       the canary against stable
    ttft p50/p99      quantile of the requests' time to first token   relative difference
    itl p50/p99       quantile of the inter-token gaps                relative difference
    error_rate        failed requests / requests                      absolute difference
    prefix_hit_rate   cached prompt tokens / prompt tokens            absolute difference
    tokens_per_s      generated tokens / window / the side's nodes    relative difference

The unit of resampling is the request (a request's gaps stay together: they share its batch), each
group resampled on its own. Tokens/s per node is a sum over the group's requests, and how many
requests a group got is itself noise (the split is a coin per conversation): a resample of a fixed
count hides that and calls the luck of the draw a difference (measured: bench/canary.py's control,
150 requests, was called ``worse``), so its resamples weigh each request by a Poisson(1) draw
instead, which lets the count vary as arrivals do.

A verdict needs the whole interval of the difference past the metric's threshold: ``worse`` when it
lies beyond +threshold in the bad direction, ``better`` beyond it in the good one, otherwise ``no
detectable difference``; noise and differences too small to matter both land there, so a control run
(both groups alike) should give no verdict at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvfleet.core.groups import CANARY, STABLE

BETTER, WORSE, SAME, TOO_FEW = "better", "worse", "no detectable difference", "too few samples"


@dataclass(slots=True, frozen=True)
class MetricSpec:
    name: str
    lower_is_better: bool
    relative: bool            # the difference as a ratio to stable's (else in absolute units)
    threshold: float          # the smallest difference that earns a verdict


DEFAULT_SPECS = (
    MetricSpec("ttft_p50_s", True, True, 0.10), MetricSpec("ttft_p99_s", True, True, 0.10),
    MetricSpec("itl_p50_s", True, True, 0.10), MetricSpec("itl_p99_s", True, True, 0.10),
    MetricSpec("error_rate", True, False, 0.01), MetricSpec("prefix_hit_rate", False, False, 0.05),
    MetricSpec("tokens_per_s_per_node", False, True, 0.10),
)


@dataclass(slots=True)
class GroupData:
    """One group's requests as arrays (index i: request i)."""

    ttft: np.ndarray          # seconds, NaN for a request without a token
    gaps: np.ndarray          # [requests, max gaps] seconds, NaN padded
    error: np.ndarray         # bool
    prompt: np.ndarray
    cached: np.ndarray
    completion: np.ndarray
    window_s: float = 1.0     # the comparison's span (both groups share it)
    nodes: int = 1

    @classmethod
    def of(cls, outcomes: Sequence[dict], window_s: float, nodes: int) -> GroupData:
        width = max((len(o["gaps_s"]) for o in outcomes), default=0) or 1
        gaps = np.full((len(outcomes), width), np.nan)
        for i, o in enumerate(outcomes):
            gaps[i, :len(o["gaps_s"])] = o["gaps_s"]
        col = lambda name: np.array([o[name] for o in outcomes], dtype=float)  # noqa: E731
        ttft = np.array([np.nan if o["ttft_s"] is None else o["ttft_s"] for o in outcomes], dtype=float)
        return cls(ttft, gaps, np.array([bool(o["error"]) for o in outcomes]), col("prompt_tokens"),
                   col("cached_tokens"), col("completion_tokens"), max(window_s, 1e-9), max(nodes, 1))

    @property
    def num_requests(self) -> int:
        return len(self.error)


def _quantile(values: np.ndarray, q: float) -> float:
    values = values[~np.isnan(values)]
    return float(np.quantile(values, q)) if values.size else float("nan")


STATS: dict[str, Callable[[GroupData, np.ndarray], float]] = {
    "ttft_p50_s": lambda g, i: _quantile(g.ttft[i], 0.5),
    "ttft_p99_s": lambda g, i: _quantile(g.ttft[i], 0.99),
    "itl_p50_s": lambda g, i: _quantile(g.gaps[i].ravel(), 0.5),
    "itl_p99_s": lambda g, i: _quantile(g.gaps[i].ravel(), 0.99),
    "error_rate": lambda g, i: float(g.error[i].mean()) if len(i) else float("nan"),
    "prefix_hit_rate": lambda g, i: float(g.cached[i].sum() / g.prompt[i].sum()) if g.prompt[i].sum() else 0.0,
    "tokens_per_s_per_node": lambda g, i: float(g.completion[i].sum() / g.window_s / g.nodes),
}


# sums whose resamples weigh each request by a Poisson(1) draw (the request count varies): [resamples, n] -> [resamples]
WEIGHTED: dict[str, Callable[[GroupData, np.ndarray], np.ndarray]] = {
    "tokens_per_s_per_node": lambda g, w: w @ g.completion / g.window_s / g.nodes,
}


@dataclass(slots=True)
class Verdict:
    metric: str
    value: dict[str, float]                         # group → point estimate
    interval: dict[str, tuple[float, float]]        # group → bootstrap interval
    difference: float                               # canary against stable (relative or absolute)
    difference_interval: tuple[float, float]
    threshold: float
    relative: bool
    verdict: str
    notes: list[str] = field(default_factory=list)


def _interval(samples: np.ndarray, confidence: float) -> tuple[float, float]:
    samples = samples[~np.isnan(samples)]
    if not samples.size:
        return (float("nan"), float("nan"))
    alpha = (1 - confidence) / 2
    return (float(np.quantile(samples, alpha)), float(np.quantile(samples, 1 - alpha)))


def _difference(canary: float, stable: float, relative: bool) -> float:
    if not relative:
        return canary - stable
    if stable == 0:
        return 0.0 if canary == 0 else float("inf")
    return (canary - stable) / stable


def compare(canary: GroupData, stable: GroupData, confidence: float = 0.95, resamples: int = 1000,
            seed: int = 0, specs: Sequence[MetricSpec] = DEFAULT_SPECS, min_requests: int = 20) -> list[Verdict]:
    """A verdict per metric of ``specs`` on the canary against stable."""
    rng = np.random.default_rng(seed)
    few = min(canary.num_requests, stable.num_requests) < min_requests
    picks = {g: [rng.integers(0, max(d.num_requests, 1), d.num_requests) for _ in range(resamples)]
             for g, d in ((CANARY, canary), (STABLE, stable))}
    data = {CANARY: canary, STABLE: stable}
    verdicts = []
    for spec in specs:
        stat = STATS[spec.name]
        point = {g: stat(d, np.arange(d.num_requests)) for g, d in data.items()}
        if spec.name in WEIGHTED:
            boot = {g: WEIGHTED[spec.name](d, rng.poisson(1.0, (resamples, d.num_requests))) for g, d in data.items()}
        else:
            boot = {g: np.array([stat(data[g], i) for i in picks[g]]) if data[g].num_requests else np.full(1, np.nan)
                    for g in data}
        diffs = np.array([_difference(c, s, spec.relative) for c, s in zip(boot[CANARY], boot[STABLE])])
        lo, hi = _interval(diffs[np.isfinite(diffs)], confidence)
        if few or np.isnan(lo):
            verdict = TOO_FEW
        else:
            bad_lo, bad_hi = (lo, hi) if spec.lower_is_better else (-hi, -lo)  # positive = worse
            verdict = WORSE if bad_lo > spec.threshold else BETTER if bad_hi < -spec.threshold else SAME
        verdicts.append(Verdict(spec.name, point, {g: _interval(b, confidence) for g, b in boot.items()},
                                _difference(point[CANARY], point[STABLE], spec.relative), (lo, hi), spec.threshold,
                                spec.relative, verdict))
    return verdicts


def groups_from_samples(bodies: Sequence[dict]) -> tuple[dict[str, GroupData], dict]:
    """Every router replica's ``/canary/samples`` merged: each side's data over one shared window,
    and the split the first replica follows."""
    outcomes: dict[str, list[dict]] = {CANARY: [], STABLE: []}
    nodes: dict[str, int] = {}
    for body in bodies:
        for group, rows in body.get("groups", {}).items():
            outcomes.setdefault(group, []).extend(rows)
        for group, n in body.get("ready_nodes", {}).items():
            nodes[group] = max(nodes.get(group, 0), n)
    rows = [o for group in outcomes.values() for o in group]
    window = (max(o["ended_at"] for o in rows) - min(o["started_at"] for o in rows)) if rows else 1.0
    split = next((b.get("split") for b in bodies if b.get("split") is not None), None)
    return {g: GroupData.of(r, window, nodes.get(g, 1)) for g, r in outcomes.items()}, {"split": split,
                                                                                        "ready_nodes": nodes}
