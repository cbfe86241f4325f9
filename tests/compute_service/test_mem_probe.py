"""The memory probe (KVFLEET_MEM_PROBE): off unless asked; when on, its lines tell Python growth
(tracemalloc, by traceback) from glibc's heap figures."""

import json
import time
import tracemalloc

from kvfleet.compute_service.node import mem_probe
from kvfleet.compute_service.node.mem_probe import MemProbe


class Held:
    def __init__(self):
        self.data = bytearray(1 << 16)


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(mem_probe.ENV_DIR, raising=False)
    assert mem_probe.start_if_asked("node-x") is None


def test_lines_show_python_growth_after_the_baseline(tmp_path):
    probe = MemProbe(tmp_path / "mem.jsonl", interval_s=60, warm_at=time.monotonic())
    try:
        first = probe.sample()  # warm: starts tracemalloc
        assert first["rss_mib"] > 0 and first["malloc"]["in_use"] > 0 and "python" not in first
        assert probe.sample()["baseline"]
        held = [Held() for _ in range(32)]  # 2 MiB that stays
        grown = probe.sample()
        assert sum(g["kib"] for g in grown["python"]["top_growth"]) >= 2048
        assert grown["python"]["object_growth"]["Held"] >= len(held)
        json.dumps(grown)  # each line is one JSON object
    finally:
        tracemalloc.stop()
