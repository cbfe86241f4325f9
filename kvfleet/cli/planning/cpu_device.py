"""The CPU as a ``Device``: its figures are measured where the plan runs, not looked up — memory
from ``/proc/meminfo``, bandwidth from a large array copy, FLOPs from a float32 matmul (numpy; a
fraction of a second)."""

from __future__ import annotations

import os
import time

import numpy as np

from kvfleet.cli.planning.devices import Device

COPY_BYTES = 256 << 20


def memory_available() -> int:
    """MemAvailable: what a process could take without swapping others out."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _best(fn, repeats: int) -> float:
    fn()  # touch the pages first
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_bandwidth(nbytes: int = COPY_BYTES, repeats: int = 5) -> float:
    """Bytes/s of a copy between two arrays larger than any cache; a copy reads and writes each
    byte, so it moves 2 x ``nbytes``."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return 2 * nbytes / _best(lambda: np.copyto(dst, src), repeats)


def measure_flops(n: int = 1024, repeats: int = 3) -> float:
    a = np.ones((n, n), dtype=np.float32)
    return 2 * n ** 3 / _best(lambda: a @ a, repeats)


def measured_cpu(memory_bytes: int | None = None, bandwidth: float | None = None) -> Device:
    """``bandwidth`` given (bytes/s) skips the copy (tests, repeatable plans)."""
    return Device("CPU (measured)", memory_bytes or memory_available(), bandwidth or measure_bandwidth(),
                  measure_flops(), runtime_overhead=0)
