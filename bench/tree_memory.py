"""Resident memory of a process and everything it started, measured the same way for both sides of
a comparison (vLLM's engine runs in child processes: its worker holds the KV cache and the weights).

``TreeMemory`` samples, every ``interval_s`` in a thread, the process tree's proportional set size
(PSS: each shared page split between the processes mapping it, so shared libraries and shared
memory count once) and keeps the highest sum; at the end it also adds up each live process's own
peak (VmHWM) and the peaks of children already waited for — an upper bound, since it counts
shared pages once per process and peaks that came at different times. Standard library only: it
runs under either side's interpreter. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import resource
import threading


def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants alive now."""
    pids, i = [pid], 0
    while i < len(pids):
        try:
            tasks = os.listdir(f"/proc/{pids[i]}/task")
        except OSError:
            tasks = []
        for task in tasks:
            try:
                with open(f"/proc/{pids[i]}/task/{task}/children") as f:
                    pids += [int(p) for p in f.read().split()]
            except OSError:
                pass
        i += 1
    return pids


def _kib(path: str, fields: tuple[str, ...]) -> dict[str, int]:
    out = dict.fromkeys(fields, 0)
    try:
        with open(path) as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in out:
                    out[name] = int(line.split()[1])
    except OSError:  # the process ended between listing and reading
        pass
    return out


def tree_pss_mib(pid: int) -> float:
    return sum(_kib(f"/proc/{p}/smaps_rollup", ("Pss",))["Pss"] for p in tree_pids(pid)) / 1024


def tree_hwm_mib(pid: int) -> float:
    """Each live process's own peak, plus the peaks of children already waited for."""
    live = sum(_kib(f"/proc/{p}/status", ("VmHWM",))["VmHWM"] for p in tree_pids(pid))
    return (live + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


class TreeMemory:
    """``with TreeMemory() as m: ...`` then ``m.figures()``: the peak PSS sampled over this process's
    tree while the block ran, and the sum of the tree's own peaks at its end."""

    def __init__(self, interval_s: float = 0.2, pid: int | None = None) -> None:
        self.pid = pid or os.getpid()
        self.interval_s = interval_s
        self.peak_pss_mib = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def _sample(self) -> None:
        self.peak_pss_mib = max(self.peak_pss_mib, tree_pss_mib(self.pid))
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> TreeMemory:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.peak_hwm_sum_mib = tree_hwm_mib(self.pid)

    def figures(self) -> dict:
        return dict(peak_pss_mib=round(self.peak_pss_mib, 1), peak_hwm_sum_mib=round(self.peak_hwm_sum_mib, 1),
                    memory_samples=self.samples)
