"""How many intra-op threads the engine computes with, re-decided from short timed probes while it
works. Pure (no torch): ``thread_probe.py`` times the candidates and applies the answer.

One thread per usable CPU is fastest on a host whose CPUs are free: a 2-vCPU host measured ~1.9x
one thread's speed on the model's matmuls, and end to end 1.38x vLLM-CPU's tokens/s in bfloat16
instead of 0.88x (docs/benchmarks-history.md, "Engine vs vLLM-CPU"). It is the slowest where another process
holds one of the CPUs: every matmul is a parallel region ending in a barrier, so a step waits out
the neighbour's time slice whenever one of its threads is descheduled (4-5x slower than one thread
under load). No fixed count serves both, and a shared host moves between them, so the engine keeps
two candidates, usable CPUs less one (vLLM's choice: a CPU left to everything else) and all of
them, and while it works times the same matmul at each: every ``interval_s`` at the smaller count,
every ``interval_more_s`` at the larger (a neighbour that starts working, another node of the same
host for one, costs the most there, so it is noticed within seconds), each interval doubled, up
to 4 times, while probes keep choosing the same count (on bench-small a probe every 3 s costs
1.2 % of the engine's time in bfloat16, 2.4 % in float32). It starts at the larger count, keeps it
while it is not slower (``speedup_keep``) and, once it has left it, takes it again only when it is
clearly faster (``speedup_up``), so a probe's noise does not flip it back and forth. A neighbour that
holds a CPU makes the larger count slower than the smaller, not a little faster; on a quiet 2-vCPU VM
the host's noise made two threads only 1.1x faster in 2 probes in a row now and then, and with a
threshold of 1.15 the engine then ran bench-small at one thread, at 0.6-0.75x its speed at two
(BENCHMARKS.md, "Engine vs vLLM-CPU").
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from kvfleet.compute_service.engine.cpu_host import THREADS_ENV, intra_op_threads

FIRST_PROBE_S = 0.0          # at the first step: a burst's first step is seconds of prefill (2.4 s at one
#                              thread against 1.3 s at two, 2,048 float32 tokens of bench-small), so it runs
#                              at the count a probe chose; one made in a start-up's noise is redone soon
PROBE_INTERVAL_S = 5.0       # between probes at the smaller count
PROBE_INTERVAL_MORE_S = 3.0  # between probes at the larger count
MAX_BACKOFF = 4              # a count chosen again and again: up to 4x the interval between probes
SPEEDUP_UP = 1.3     # the larger count must be this much faster to be taken again...
SPEEDUP_KEEP = 1.0   # ...and kept while it is not slower


def thread_candidates(usable_cpus: int, env: Mapping[str, str]) -> tuple[int, ...]:
    """The counts the engine chooses between, fewer first: one fixed count where
    ``KVFLEET_CPU_THREADS`` names it or the host has one CPU, none where ``OMP_NUM_THREADS`` was
    set by whoever started the process (torch's own choice stands), otherwise usable CPUs less
    one and all of them. ``ValueError`` in one line for a bad ``KVFLEET_CPU_THREADS``."""
    fixed = intra_op_threads(usable_cpus, env)
    if fixed is None:
        return ()
    if THREADS_ENV in env or usable_cpus <= 1:
        return (fixed,)
    return (fixed, usable_cpus)


class ThreadGovernor:
    """Decides between ``candidates`` (fewer, more) from the seconds each took on the same probe.

    ``due(now)`` says when to probe (``first_probe_s`` after it is first asked, then as the
    interval of the current count says); ``decide`` takes the
    probe's seconds per candidate and returns the count to run with. With one candidate it is
    never due and ``current`` is that count."""

    def __init__(self, candidates: tuple[int, ...], interval_s: float = PROBE_INTERVAL_S,
                 interval_more_s: float = PROBE_INTERVAL_MORE_S, speedup_up: float = SPEEDUP_UP,
                 speedup_keep: float = SPEEDUP_KEEP, first_probe_s: float = FIRST_PROBE_S):
        if not candidates or len(candidates) > 2 or any(c < 1 for c in candidates):
            raise ValueError(f"thread candidates must be one or two positive counts, got {candidates!r}")
        if interval_s <= 0 or interval_more_s <= 0 or not 1 <= speedup_keep <= speedup_up:
            raise ValueError("need positive intervals and 1 <= speedup_keep <= speedup_up")
        self.candidates = tuple(sorted(set(candidates)))
        self.interval_s, self.interval_more_s = interval_s, interval_more_s
        self.first_probe_s = first_probe_s
        self._backoff = 1  # doubles each time a probe keeps the count, back to 1 when one changes it
        self.speedup_up, self.speedup_keep = speedup_up, speedup_keep
        self.current = self.candidates[-1]  # a host's CPUs are free until a probe finds otherwise
        self.chosen = Counter()  # count -> how many probes chose it
        self._last_probe: float | None = None
        self._pending: int | None = None  # a probe's answer that another must confirm before it moves the count

    @property
    def adaptive(self) -> bool:
        return len(self.candidates) == 2

    def due(self, now: float) -> bool:
        if not self.adaptive:
            return False
        if self._pending is not None:  # the confirming probe: at the next step
            return True
        interval = (self.interval_more_s if self.current == self.candidates[-1] else self.interval_s) * self._backoff
        if self._last_probe is None:  # the clock starts at the first step
            self._last_probe = now - interval + self.first_probe_s
        return now - self._last_probe >= interval

    def without_probes(self) -> int:
        """The count to keep when probing cannot go on: the smaller (a CPU left to everything else),
        since no probe will see a neighbour that takes one."""
        self.current = self.candidates[0]
        return self.current

    def decide(self, seconds: Mapping[int, float], now: float) -> int:
        """The count to run with after a probe that took ``seconds[count]`` at each candidate. A
        probe that answers another count than the current one moves it only when the next probe,
        made at the next step (``due``), answers the same: one probe slowed by a moment of the
        host's noise (seen on a quiet 2-vCPU VM: 1 probe in 10 had two threads at 0.84x one
        thread's speed against 1.8x in the others) would otherwise halve the engine's speed until
        the next probe, seconds later; a neighbour that holds a CPU slows both probes. The first
        probe moves it at once: a burst's first step is its longest (prefill)."""
        fewer, more = self.candidates
        needed = self.speedup_keep if self.current == more else self.speedup_up
        answer = more if seconds[more] * needed <= seconds[fewer] else fewer
        first = not self.chosen
        self._last_probe = now
        self.chosen[answer] += 1
        if first and answer != self.current:
            self.current = answer
        elif answer == self.current:
            self._pending = None
            self._backoff = min(self._backoff * 2, MAX_BACKOFF)
        elif self._pending == answer:
            self._pending, self.current, self._backoff = None, answer, 1
        else:
            self._pending = answer
        return self.current
