"""Resident memory per process over a long run: VmRSS sampled on a clock, the figures at named
moments (start, after warm-up, end), and each process's growth after warm-up as a slope
(``rss_slope``); for the compute nodes, the heap view of their memory probe beside it.

The heap view is ``kvfleet/compute_service/node/mem_probe.py``'s cheap half: glibc's ``mallinfo2`` (bytes
in use, free inside the heap) on the node's own thread, written to a file; a soak turns it on with
``probe_env``. Its slopes tell a leak (``in_use`` rising: memory something holds) from
fragmentation (``free`` rising, ``in_use`` flat). tracemalloc, the probe's other half, slows every
allocation, so it stays off unless the caller's environment asks for it (``KVFLEET_MEM_PROBE_WARMUP``);
then its traced total gets a slope too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfleet.cli.loadgen.rss_slope import Slope, fit_after, rss_slope, worst
from kvfleet.cli.loadgen.server_side import rss_mib
from kvfleet.compute_service.node.mem_probe import ENV_DIR, ENV_INTERVAL, ENV_WARMUP

MOMENTS = ("start", "warm", "end")
NEVER_S = "1e12"  # a warm-up that never ends: tracemalloc is never started


def probe_env(directory: Path, interval_s: float) -> dict[str, str]:
    """The variables that make each node write its heap lines into ``directory`` every
    ``interval_s`` (a caller that set ``KVFLEET_MEM_PROBE`` itself keeps its own settings)."""
    if os.environ.get(ENV_DIR):
        return {}
    return {ENV_DIR: str(directory), ENV_INTERVAL: f"{interval_s:g}", ENV_WARMUP: os.environ.get(ENV_WARMUP, NEVER_S)}


def probe_dir() -> Path | None:
    return Path(os.environ[ENV_DIR]) if os.environ.get(ENV_DIR) else None


def heap_slopes(path: Path, run_started_wall: float, warmup_s: float) -> dict[str, Slope | float | None]:
    """From one node process's probe file: the slopes (and last values) of glibc's bytes in use and
    free, and of tracemalloc's total where it ran, from ``warmup_s`` after the later of the run's
    start and the file's first line (wall-clock seconds)."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return {}
    warm_from = max(run_started_wall, lines[0]["t"]) + warmup_s
    views = {
        "heap_in_use": [(ln["t"], (ln.get("malloc") or {}).get("in_use")) for ln in lines],
        "heap_free": [(ln["t"], (ln.get("malloc") or {}).get("free")) for ln in lines],
        "python_traced": [(ln["t"], ln["python"]["traced_mib"]) for ln in lines if "python" in ln],
    }
    out: dict[str, Slope | float | None] = {}
    for view, points in views.items():
        if any(v is not None for _, v in points):
            out[f"{view}_slope"] = fit_after(points, warm_from)
            out[f"{view}_end_mib"] = next(v for _, v in reversed(points) if v is not None)
    return out


@dataclass(slots=True)
class MemoryTrack:
    """``sample(pids, now)`` on a clock (``now``: seconds since the run started); ``moment`` names
    the samples the summary shows as columns."""

    series: dict[str, list[tuple[float, int, float | None]]] = field(default_factory=dict)  # name → (t, pid, MiB)
    moments: dict[str, dict[str, tuple[int, float | None]]] = field(default_factory=dict)   # moment → name → (pid, MiB)

    def sample(self, pids: Mapping[str, int], now: float, moment: str | None = None) -> None:
        read = {name: (pid, rss_mib(pid)) for name, pid in pids.items()}
        for name, (pid, mib) in read.items():
            self.series.setdefault(name, []).append((now, pid, mib))
        if moment:
            self.moments[moment] = read

    def slopes(self, warmup_s: float) -> dict[str, Slope]:
        return {name: rss_slope(samples, warmup_s) for name, samples in self.series.items()}

    def report(self, warmup_s: float, heap: Mapping[str, Mapping] | None = None) -> dict[str, dict]:
        """Per process: its pid at the end, the moments' MiB, growth (end against warm, same pid),
        the slope and its fit, the last pid's samples, and the heap view where there is one."""
        out, heap = {}, heap or {}
        for name, slope in self.slopes(warmup_s).items():
            pid = self.series[name][-1][1]
            cells = {m: self.moments.get(m, {}).get(name) for m in MOMENTS}
            warm, end = cells["warm"], cells["end"]
            same = warm and end and warm[0] == end[0] and warm[1] is not None and end[1] is not None
            out[name] = {
                "pid": pid,
                **{f"{m}_mib": _round(cell[1] if cell else None) for m, cell in cells.items()},
                "growth_mib": _round(end[1] - warm[1]) if same else None,
                "rss_slope_mib_per_hour": _round(slope.mib_per_hour),
                "slope_samples": slope.samples, "slope_span_s": round(slope.span_s), "slope_reason": slope.reason,
                "rss_mib_series": [[round(t), _round(mib)] for t, p, mib in self.series[name] if p == pid],
                **({"heap": _heap_json(heap[name])} if name in heap else {}),
            }
        return out

    def worst(self, warmup_s: float) -> dict | None:
        found = worst(self.slopes(warmup_s))
        return {"process": found[0], "rss_slope_mib_per_hour": _round(found[1])} if found else None

    def table(self, warmup_s: float, heap: Mapping[str, Mapping] | None = None) -> list[str]:
        rows = self.report(warmup_s, heap)
        lines = [f"{'process':<14} {'pid':>8} {'start MiB':>10} {'warm MiB':>10} {'end MiB':>10} {'growth':>8} "
                 f"{'MiB/h':>8} {'fit':>10}"]
        for name, row in rows.items():
            def mib(key: str) -> str:
                return f"{row[key]:.1f}" if row[key] is not None else "-"

            growth = f"{row['growth_mib']:+.1f}" if row["growth_mib"] is not None else "restarted"
            slope = f"{row['rss_slope_mib_per_hour']:+.1f}" if row["rss_slope_mib_per_hour"] is not None else "-"
            fit = f"{row['slope_samples']} / {row['slope_span_s']}s"
            lines.append(f"{name:<14} {row['pid']:>8} {mib('start_mib'):>10} {mib('warm_mib'):>10} "
                         f"{mib('end_mib'):>10} {growth:>8} {slope:>8} {fit:>10}")
        lines.append(f"(growth: end against after warm-up, same process; MiB/h: least-squares slope of the samples "
                     f"{warmup_s:g} s after the start or a restart on, over samples / seconds)")
        suffix = "_slope_mib_per_hour"
        for name, row in rows.items():
            if "heap" in row:
                lines.append(f"{name} heap (mallinfo2), MiB/h after warm-up: " + ", ".join(
                    f"{key.removeprefix('heap_').removesuffix(suffix)} {value:+.1f}" for key, value in row["heap"].items()
                    if key.endswith(suffix) and value is not None))
        return lines


def _heap_json(view: Mapping) -> dict:
    return {(f"{key}_mib_per_hour" if isinstance(v, Slope) else key): _round(v.mib_per_hour if isinstance(v, Slope) else v)
            for key, v in view.items()}


def _round(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None
