"""The bench's output directory: ``summary.json`` (every phase's figures, the servers' counters,
drift verdicts), ``requests.csv`` (one row per request), ``kv_usage.csv`` (the samples) and the
PNGs; and the few lines printed at the end."""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, fields
from pathlib import Path

from kvfleet.cli.loadgen import plots
from kvfleet.cli.loadgen.phases import PhaseResult
from kvfleet.cli.loadgen.records import RequestRecord


def check_writable(out: Path) -> str | None:
    """None when ``out`` is (or can be made) a writable directory, else a line saying why not."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"cannot create the output directory {out}: {err.strerror or err}"
    if not out.is_dir() or not os.access(out, os.W_OK | os.X_OK):
        return f"cannot write into the output directory {out}"
    return None


def phase_json(result: PhaseResult) -> dict:
    d = {"concurrency": result.concurrency, **result.stats.to_json()}
    if result.steps:
        d["steps"] = [{"concurrency": c, **s.to_json()} for c, s in result.steps]
        d["stop_reason"] = result.stop_reason
    if result.name == "soak":
        d["drift"] = [{**asdict(x), "verdict": x.line()} for x in result.drifts]
        d["drift_flagged"] = any(x.flagged for x in result.drifts)
    return d


def client_totals(results: list[PhaseResult]) -> dict:
    """What the client saw finish: to set beside the router's own counters."""
    done = [r for res in results for r in res.records if r.ok]
    return {"requests_finished": len(done),
            "prompt_tokens": sum(r.usage_prompt_tokens for r in done),
            "generation_tokens": sum(r.completion_tokens for r in done)}


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def write(out: Path, summary: dict, results: list[PhaseResult], samples) -> list[str]:
    """Every file of the bench into ``out``; returns their names."""
    records = [r for res in results for r in res.records]
    write_csv(out / "requests.csv", [r.row() for r in records] if records else
              [dict.fromkeys(f.name for f in fields(RequestRecord))])
    write_csv(out / "kv_usage.csv", [{"t_s": s.t_s, "phase": s.phase, "blocks_used": s.blocks_used,
                                      "blocks_total": s.blocks_total,
                                      **{f"rss_mib {k}": v for k, v in s.rss_mib.items()}} for s in samples])
    files = ["summary.json", "requests.csv", "kv_usage.csv"]
    fixed = next((res for res in results if res.name == "fixed"), None)
    if fixed is not None:
        plots.throughput_vs_concurrency(out / "fixed_throughput_p99.png", fixed.steps,
                                        f"fixed phase: {summary['plan']['context']}-token prompts")
        files.append("fixed_throughput_p99.png")
    by_phase = {res.name: {"ttft": [r.ttft_s for r in res.records if r.ok],
                           "itl": [g for r in res.records if r.ok for g in r.itl_s],
                           "e2e": [r.e2e_s for r in res.records if r.ok]} for res in results}
    plots.latency_cdfs(out / "latency_cdf.png", by_phase)
    files.append("latency_cdf.png")
    if samples:
        plots.usage_over_time(out / "kv_usage.png", samples)
        files.append("kv_usage.png")
    summary["files"] = files
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return files


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def lines(results: list[PhaseResult]) -> list[str]:
    """One line per phase (and per fixed step): what a person reads at the end."""
    out = [f"{'phase':<8} {'conc':>4} {'reqs':>5} {'ok':>5} {'tok/s':>8} {'TTFT p50/p99 ms':>16} "
           f"{'ITL p50/p99 ms':>15} {'e2e p99 ms':>10}  refusals"]

    def row(name: str, c: int, s) -> str:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(s.refusals.items())) or "-"
        return (f"{name:<8} {c:>4} {s.requests:>5} {s.completed:>5} {s.tokens_per_s:>8.1f} "
                f"{_ms(s.ttft_s['p50']) + '/' + _ms(s.ttft_s['p99']):>16} "
                f"{_ms(s.itl_s['p50']) + '/' + _ms(s.itl_s['p99']):>15} {_ms(s.e2e_s['p99']):>10}  {refused}")

    for res in results:
        for c, s in res.steps:
            out.append(row("  step", c, s))
        out.append(row(res.name, res.concurrency, res.stats))
        if res.stop_reason:
            out.append(f"  fixed phase stopped: {res.stop_reason}")
        out += [f"  {d.line()}" for d in res.drifts]
    return out
