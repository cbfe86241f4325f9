"""A diagnostic for a node whose resident memory grows: where does it go? Off unless
``KVFLEET_MEM_PROBE`` names a directory; then a daemon thread writes one JSON line every
``KVFLEET_MEM_PROBE_INTERVAL`` seconds (default 60) to ``<dir>/mem-<name>-<pid>.jsonl``. The
first sample at least ``KVFLEET_MEM_PROBE_WARMUP`` seconds (default 120) after the start is the
baseline the later ones are diffed against, so that the warm-up's own growth is left out.

Each line holds the three views that tell a leak from fragmentation apart:

- ``rss_mib``: what the soak reports (VmRSS);
- ``malloc``: glibc's ``mallinfo2`` (bytes in use, free inside the heap, mmapped, arena bytes).
  Growth in ``in_use`` is memory something holds (Python or native: torch, gRPC); growth in
  ``free`` with ``in_use`` flat is fragmentation, memory glibc keeps but nobody holds;
- ``python``: tracemalloc's total and its top growers since the first line, by traceback, and the
  gc-tracked object counts by type that grew most. A Python leak shows here; native memory does not.

tracemalloc is started only at the end of the warm-up (traced from the start, importing torch
alone takes minutes) and slows every allocation after it: the probe is for diagnosis runs, not for
serving. Growth after the baseline is all traced, which is what a diff needs. The probe itself
touches neither torch nor grpc.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import json
import os
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

ENV_DIR = "KVFLEET_MEM_PROBE"
ENV_INTERVAL = "KVFLEET_MEM_PROBE_INTERVAL"
ENV_WARMUP = "KVFLEET_MEM_PROBE_WARMUP"
TRACE_FRAMES = 12
TOP = 15


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def malloc_info() -> dict[str, float] | None:
    """glibc's view of the heap in MiB, or None where this libc has no ``mallinfo2`` (musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    mib = 1 / (1 << 20)
    return {"arena": info.arena * mib, "in_use": info.uordblks * mib, "free": info.fordblks * mib,
            "mmapped": info.hblkhd * mib, "top_pad": info.keepcost * mib}


def rss_mib() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def object_counts() -> collections.Counter:
    return collections.Counter(type(o).__qualname__ for o in gc.get_objects())


@dataclass(slots=True)
class MemProbe:
    """One process's probe: the first sample after the warm-up is the baseline of the later ones."""

    path: Path
    interval_s: float
    warm_at: float  # time.monotonic() from which on a sample may be the baseline
    baseline: tracemalloc.Snapshot | None = None
    baseline_counts: collections.Counter | None = None

    def sample(self) -> dict:
        line = {"t": round(time.time(), 1), "rss_mib": rss_mib(), "malloc": malloc_info()}
        if not tracemalloc.is_tracing():
            if time.monotonic() >= self.warm_at:
                tracemalloc.start(TRACE_FRAMES)  # the next sample is the baseline
            return line
        snapshot = tracemalloc.take_snapshot().filter_traces((
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
        ))
        counts = object_counts()
        line["python"] = {"traced_mib": tracemalloc.get_traced_memory()[0] / (1 << 20),
                          "objects": sum(counts.values())}
        if self.baseline is None:
            line["baseline"] = True
            self.baseline, self.baseline_counts = snapshot, counts
        else:
            diff = snapshot.compare_to(self.baseline, "traceback")
            line["python"]["top_growth"] = [
                {"kib": round(stat.size_diff / 1024, 1), "count": stat.count_diff,
                 "where": [f"{f.filename}:{f.lineno}" for f in stat.traceback][-TRACE_FRAMES:]}
                for stat in diff[:TOP] if stat.size_diff > 0]
            grown = counts.copy()
            grown.subtract(self.baseline_counts)
            line["python"]["object_growth"] = dict(grown.most_common(TOP))
        return line

    def run(self) -> None:
        while True:
            line = self.sample()
            with self.path.open("a") as out:
                out.write(json.dumps(line) + "\n")
            time.sleep(self.interval_s)


def start_if_asked(name: str) -> MemProbe | None:
    """Called first thing in a node's run: its first lines show the start's growth too."""
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    interval = float(os.environ.get(ENV_INTERVAL, "60"))
    warm_at = time.monotonic() + float(os.environ.get(ENV_WARMUP, "120"))
    Path(directory).mkdir(parents=True, exist_ok=True)
    probe = MemProbe(Path(directory) / f"mem-{name}-{os.getpid()}.jsonl", interval, warm_at)
    threading.Thread(target=probe.run, name="mem-probe", daemon=True).start()
    return probe
