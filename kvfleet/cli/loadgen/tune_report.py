"""``kvfleet tune``'s output directory: the winner as a ``kvfleet up --config`` file, the table
(``report.md``, also printed), ``tune.png`` and ``summary.json``."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

from kvfleet.cli.config_file import dump_yaml
from kvfleet.cli.loadgen import plots
from kvfleet.cli.loadgen.local import ClusterShape
from kvfleet.cli.loadgen.phases import PhasePlan
from kvfleet.cli.loadgen.search import Candidate, Run, Search

CONFIG_NAME = "kvfleet-tuned.yaml"


def _num(x: float) -> float | None:
    return None if math.isnan(x) else x


def table(baseline: Candidate, search: Search, winner: Candidate) -> list[str]:
    slo = search.slo_ms
    out = [f"| block size | runs | tokens/s | p99 inter-token ms | within {slo:g} ms | vs baseline |",
           "|---:|---:|---:|---:|:---:|---:|"]
    for c in [baseline, *sorted(search.candidates.values(), key=lambda c: c.block_size)]:
        ratio = c.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else math.nan
        mark = " (baseline)" if c is baseline else (" **winner**" if c is winner else "")
        out.append(f"| {c.block_size}{mark} | {len(c.runs)} | {c.tokens_per_s:.1f} | {c.p99_itl_ms:.1f} | "
                   f"{'yes' if c.within(slo) else 'no'} | {ratio:.2f}x |")
    return out


def write_tune(out: Path, args, plan: PhasePlan, shape: ClusterShape, baseline_runs: list[Run], search: Search,
               winner: Candidate, cpu: str) -> list[str]:
    """Every file into ``out``; returns the lines to print."""
    baseline = Candidate(baseline_runs[0].block_size, list(baseline_runs))
    tuned = replace(shape, block_size=winner.block_size)
    header = (f"kvfleet tune: block_size {winner.block_size} gave {winner.tokens_per_s:.1f} tokens/s with p99 "
              f"inter-token {winner.p99_itl_ms:.1f} ms (SLO {search.slo_ms:g} ms)\n"
              f"workload: mix {plan.mix.describe()}, {plan.max_tokens} tokens out, {plan.concurrency} clients\n"
              f"start it with: kvfleet up --config {CONFIG_NAME}")
    (out / CONFIG_NAME).write_text(dump_yaml(asdict(tuned), header))
    rows = table(baseline, search, winner)
    verdict = (f"winner: block_size {winner.block_size}" + ("" if winner.within(search.slo_ms) else
               f" (no size met the {search.slo_ms:g} ms SLO: the closest is written)"))
    (out / "report.md").write_text("\n".join([f"# kvfleet tune ({cpu})", "", *rows, "", verdict, ""]))
    every_run = [*baseline.runs, *(r for c in search.candidates.values() for r in c.runs)]
    plots.tune_curve(out / "tune.png", every_run, search.slo_ms)
    summary = {
        "command": "kvfleet tune",
        "machine": {"cpu": cpu},
        "slo_ms": search.slo_ms,
        "grid": search.grid,
        "search_order": search.order,
        "repeats": search.repeats, "confirm": search.confirm,
        "workload": {"mix": plan.mix.describe(), "scale": args.scale, "max_tokens": plan.max_tokens,
                     "concurrency": plan.concurrency, "requests": plan.mixed_requests},
        "cluster": asdict(shape),
        "baseline": _candidate_json(baseline, search.slo_ms),
        "candidates": [_candidate_json(c, search.slo_ms) for c in search.ranked()],
        "winner": _candidate_json(winner, search.slo_ms),
        "winner_vs_baseline": winner.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else None,
        "config_file": CONFIG_NAME,
        "files": ["summary.json", CONFIG_NAME, "report.md", "tune.png"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return [*rows, verdict, f"results in {out}/ ({', '.join(summary['files'])}); "
            f"kvfleet up --config {out / CONFIG_NAME}"]


def _candidate_json(c: Candidate, slo_ms: float) -> dict:
    return {"block_size": c.block_size, "tokens_per_s": c.tokens_per_s, "p99_itl_ms": _num(c.p99_itl_ms),
            "within_slo": c.within(slo_ms),
            "runs": [{**asdict(r), "p99_itl_ms": _num(r.p99_itl_ms)} for r in c.runs]}
