"""The soak's memory figures (issue 35): samples per process, the moments, slopes per process and
the steepest, and a node's heap lines read back as slopes."""

from __future__ import annotations

import json
import os
import time

import pytest

from kvfleet.cli.loadgen.memory_track import NEVER_S, MemoryTrack, heap_slopes, probe_env
from kvfleet.compute_service.node import mem_probe

GONE = 2**22 + 1  # above Linux's pid_max default: no such process


def test_samples_moments_slopes_and_the_report():
    track = MemoryTrack()
    me = os.getpid()
    for t in range(0, 301, 30):
        track.sample({"soak clients": me, "gone": GONE}, float(t), "start" if t == 0 else "warm" if t == 60 else None)
    track.sample({"soak clients": me, "gone": GONE}, 330.0, "end")
    rows = track.report(warmup_s=60)
    mine = rows["soak clients"]
    assert mine["pid"] == me and mine["start_mib"] > 0 and mine["end_mib"] > 0
    assert mine["slope_samples"] == 10 and mine["slope_span_s"] == 270 and mine["rss_slope_mib_per_hour"] is not None
    assert len(mine["rss_mib_series"]) == 12 and mine["growth_mib"] == pytest.approx(mine["end_mib"] - mine["warm_mib"])
    assert rows["gone"]["rss_slope_mib_per_hour"] is None and rows["gone"]["slope_reason"].startswith("0 samples")
    assert rows["gone"]["growth_mib"] is None
    assert track.worst(60)["process"] == "soak clients"
    table = "\n".join(track.table(60))
    assert "soak clients" in table and "10 / 270s" in table and "restarted" in table  # "gone": no growth figure


def test_a_restarted_process_shows_as_restarted_and_is_fitted_anew():
    track = MemoryTrack()
    track.series["node-0"] = [(float(t), 41, 500.0 + t) for t in range(0, 300, 30)]
    track.series["node-0"] += [(float(t), 97, 400.0) for t in range(300, 601, 30)]
    track.moments = {"warm": {"node-0": (41, 560.0)}, "end": {"node-0": (97, 400.0)}}
    row = track.report(warmup_s=60)["node-0"]
    assert row["pid"] == 97 and row["growth_mib"] is None and row["rss_slope_mib_per_hour"] == 0
    assert row["slope_samples"] == 9 and len(row["rss_mib_series"]) == 11


def probe_lines(path, probe, start_wall, in_use, free):
    """Real probe lines (``MemProbe.sample``) with their time and heap figures set."""
    with path.open("w") as out:
        for i, (used, spare) in enumerate(zip(in_use, free)):
            line = probe.sample()
            line["t"] = start_wall + 30 * i
            line["malloc"] = {**(line["malloc"] or {}), "in_use": used, "free": spare}
            out.write(json.dumps(line) + "\n")


def test_heap_lines_become_slopes(tmp_path):
    path = tmp_path / "mem-node-0-123.jsonl"
    probe = mem_probe.MemProbe(path, 30, warm_at=time.monotonic() + 1e9)  # tracemalloc never starts
    in_use = [100 + 2 * i for i in range(4)] + [110 + 0.025 * i for i in range(30)]  # 3 MiB/h once warm
    probe_lines(path, probe, 1000.0, in_use, [20.0] * len(in_use))
    view = heap_slopes(path, run_started_wall=1000.0, warmup_s=120)
    assert view["heap_in_use_slope"].mib_per_hour == pytest.approx(3) and view["heap_in_use_slope"].samples == 30
    assert view["heap_free_slope"].mib_per_hour == pytest.approx(0) and view["heap_free_end_mib"] == 20
    assert "python_traced_slope" not in view  # tracemalloc did not run
    track = MemoryTrack()
    track.series["node-0"] = [(float(t), 123, 500.0) for t in range(0, 600, 30)]
    row = track.report(120, {"node-0": view})["node-0"]
    assert row["heap"]["heap_in_use_slope_mib_per_hour"] == 3.0 and row["heap"]["heap_in_use_end_mib"] == 110.72
    assert any(line.startswith("node-0 heap") and "in_use +3.0, free +0.0" in line for line in track.table(120, {"node-0": view}))


def test_the_probe_env_turns_on_the_cheap_view_unless_the_caller_set_its_own(tmp_path, monkeypatch):
    monkeypatch.delenv(mem_probe.ENV_DIR, raising=False)
    monkeypatch.delenv(mem_probe.ENV_WARMUP, raising=False)
    assert probe_env(tmp_path, 5) == {mem_probe.ENV_DIR: str(tmp_path), mem_probe.ENV_INTERVAL: "5",
                                      mem_probe.ENV_WARMUP: NEVER_S}
    monkeypatch.setenv(mem_probe.ENV_DIR, "/elsewhere")
    assert probe_env(tmp_path, 5) == {}
