"""The bench's and the tune's PNGs (matplotlib, Agg backend: no display needed), small on purpose:
they are committed with benchmark results."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

DPI = 80
PHASE_COLOURS = {"fixed": "tab:blue", "mixed": "tab:orange", "soak": "tab:green"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ms(values: Sequence[float | None]) -> list[float]:
    return [float("nan") if v is None else v * 1000 for v in values]


def throughput_vs_concurrency(path: Path, steps, title: str) -> None:
    """Tokens/s and p99 latencies against the fixed phase's concurrency steps."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    xs = [c for c, _ in steps]
    fig, left = plt.subplots(figsize=(6, 3.5), dpi=DPI)
    left.plot(xs, [s.tokens_per_s for _, s in steps], "o-", color="tab:blue", label="tokens/s")
    left.set_xlabel("concurrent requests")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_ylabel("generated tokens/s", color="tab:blue")
    right = left.twinx()
    right.plot(xs, _ms([s.ttft_s["p99"] for _, s in steps]), "s--", color="tab:red", label="p99 TTFT")
    right.plot(xs, _ms([s.itl_s["p99"] for _, s in steps]), "^--", color="tab:purple", label="p99 inter-token")
    right.set_ylabel("p99 latency (ms)")
    lines = left.get_lines() + right.get_lines()
    left.legend(lines, [line.get_label() for line in lines], loc="upper left", fontsize=8)
    left.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def latency_cdfs(path: Path, by_phase: dict[str, dict[str, list[float]]]) -> None:
    """Per latency (TTFT, inter-token, end-to-end), one CDF line per phase."""
    plt = _pyplot()
    kinds = ("ttft", "itl", "e2e")
    titles = {"ttft": "TTFT", "itl": "inter-token", "e2e": "end-to-end"}
    fig, axes = plt.subplots(1, 3, figsize=(9, 3), dpi=DPI)
    for ax, kind in zip(axes, kinds):
        for phase, values in by_phase.items():
            data = sorted(v * 1000 for v in values[kind])
            if data:
                ax.step(data, [(i + 1) / len(data) for i in range(len(data))], where="post",
                        color=PHASE_COLOURS.get(phase), label=phase)
        ax.set_title(titles[kind], fontsize=10)
        ax.set_xlabel("ms")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of requests (gaps)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def usage_over_time(path: Path, samples) -> None:
    """Blocks in use over time, each phase in its colour; below it each process's RSS when read."""
    plt = _pyplot()
    with_rss = any(s.rss_mib for s in samples)
    fig, axes = plt.subplots(2 if with_rss else 1, 1, figsize=(6, 5 if with_rss else 3), dpi=DPI, sharex=True,
                             squeeze=False)
    kv = axes[0][0]
    for phase in dict.fromkeys(s.phase for s in samples):
        points = [(s.t_s, s.blocks_used) for s in samples if s.phase == phase and s.blocks_used is not None]
        if points:
            kv.plot([t for t, _ in points], [u for _, u in points], ".-", color=PHASE_COLOURS.get(phase), label=phase)
    total = next((s.blocks_total for s in samples if s.blocks_total), None)
    if total:
        kv.axhline(total, color="grey", linestyle=":", label="pool size")
    kv.set_ylabel("KV blocks in use")
    kv.legend(fontsize=8)
    if with_rss:
        mem = axes[1][0]
        for name in sorted({n for s in samples for n in s.rss_mib}):
            points = [(s.t_s, s.rss_mib[name]) for s in samples if name in s.rss_mib]
            mem.plot([t for t, _ in points], [v for _, v in points], label=name)
        mem.set_ylabel("RSS (MiB)")
        mem.legend(fontsize=7)
    axes[-1][0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def tune_curve(path: Path, rows, slo_ms: float) -> None:
    """Tokens/s and p99 inter-token latency against block size (log scale), every run a point."""
    plt = _pyplot()
    fig, left = plt.subplots(figsize=(6, 3.5), dpi=DPI)
    left.scatter([r.block_size for r in rows], [r.tokens_per_s for r in rows], color="tab:blue", label="tokens/s")
    left.set_xscale("log", base=2)
    left.set_xlabel("block size (tokens)")
    left.set_ylabel("generated tokens/s", color="tab:blue")
    right = left.twinx()
    right.scatter([r.block_size for r in rows], [r.p99_itl_ms for r in rows], marker="^", color="tab:red",
                  label="p99 inter-token")
    right.axhline(slo_ms, color="tab:red", linestyle=":", label=f"SLO {slo_ms:g} ms")
    right.set_ylabel("p99 inter-token (ms)")
    handles = [*left.collections, *right.collections, *right.get_lines()]
    left.legend(handles, [h.get_label() for h in handles], loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
