"""Times one of the model's own linear layers at each intra-op thread count the governor weighs
(``thread_governor.py``) and sets torch's count to its answer. Runs on the engine's step thread,
between steps. The layer is the widest of those every decoder layer has (an MLP projection), not
the output head, several times larger on a real vocabulary (SmolLM2's: 576 x 49,152 against the
MLP's 576 x 3,072). On bench-small (its MLP: 768 -> 4,096) a probe takes 73 ms in float32 and
35 ms in bfloat16: 12 calls of 64 rows at each count. Shorter probes (6 calls of 32 rows: 22 and
9 ms) did not see a neighbour that held a CPU (they chose two threads and ran 0.6x one thread's
speed), so probes are this long and few: every 5 s, every 3 s at the larger count, backing off
to 4x that while they keep the count (under 1 % of the engine's time in bfloat16 once backed off)."""

from __future__ import annotations

import logging
import math
import time
from collections import Counter

import torch
from torch import nn

from kvfleet.compute_service.engine.thread_governor import ThreadGovernor

log = logging.getLogger(__name__)

PROBE_ROWS = 64   # a decode batch's rows; a row count the packed layers were warmed up for
ROUNDS, CALLS = 3, 4  # rounds alternate the counts; each round times CALLS calls at a count, at least
MIN_PROBE_S = 0.02    # ...and as many more as make the fewer count's share this long: SmolLM2's MLP
#                       (576 x 3,072) takes 0.57 ms a call in bfloat16, so 12 calls were 7 ms, and a
#                       moment of a VM's noise flipped the answer
MAX_CALLS = 64


class ThreadProbe:
    def __init__(self, model: nn.Module, dtype: torch.dtype, governor: ThreadGovernor):
        """``dtype``: the model's activations'; the probe feeds its layer rows of it."""
        self.governor = governor
        self.calls = CALLS  # per round; grown after the first probe to last MIN_PROBE_S (calls_for)
        self._layer = _widest_linear(model, dtype) if governor.adaptive else None
        torch.set_num_threads(governor.current)

    def maybe_probe(self) -> None:
        """Probe if it is time; a probe that fails turns probing off (with a warning) and the engine
        serves on at the smaller count."""
        now = time.monotonic()
        if self._layer is None or not self.governor.due(now):
            return
        try:
            self._probe(now)
        except Exception as e:  # a layer that cannot take the probe's rows: keep serving without it
            self._layer = None
            torch.set_num_threads(self.governor.without_probes())
            log.warning("intra-op thread probe failed, staying at %d threads: %s", self.governor.current, e)

    def _probe(self, now: float) -> None:
        layer, x = self._layer
        seconds = dict.fromkeys(self.governor.candidates, 0.0)
        with torch.inference_mode():
            for _ in range(ROUNDS):
                for threads in seconds:
                    torch.set_num_threads(threads)
                    started = time.perf_counter()
                    for _ in range(self.calls):
                        layer(x)
                    seconds[threads] += time.perf_counter() - started
        self.calls = calls_for(seconds[self.governor.candidates[0]] / (ROUNDS * self.calls))
        # compared by the total, not the median call: a neighbour that holds a CPU stalls some of
        # the calls at the larger count, and the stalls are what it costs (by the median, two
        # threads won under a busy neighbour and then ran at 0.7x one thread's speed)
        before = self.governor.current
        chosen = self.governor.decide(seconds, now)
        torch.set_num_threads(chosen)
        if chosen != before:
            log.info("intra-op threads %d -> %d (probe: %s)", before, chosen,
                     ", ".join(f"{t} threads {s * 1e3:.1f} ms" for t, s in seconds.items()))


def _widest_linear(model: nn.Module, dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor] | None:
    """The widest linear layer whose shape recurs (every decoder layer has one: an MLP projection;
    the output head and embeddings occur once), or the widest of all in a model with no repeated
    shape, and a probe input for it: ``PROBE_ROWS`` rows of zeros (a matmul's time does not depend
    on values)."""
    linears = [m for m in model.modules()
               if isinstance(getattr(m, "in_features", None), int) and isinstance(getattr(m, "out_features", None), int)]
    if not linears:
        return None
    shapes = Counter((m.in_features, m.out_features) for m in linears)
    candidates = [m for m in linears if shapes[m.in_features, m.out_features] > 1] or linears
    module = max(candidates, key=lambda m: m.in_features * m.out_features)
    return module, torch.zeros(PROBE_ROWS, module.in_features, dtype=dtype)


def calls_for(seconds_per_call: float) -> int:
    """Calls per round that make a probe's rounds at the fewer count last ``MIN_PROBE_S``."""
    wanted = MIN_PROBE_S / (ROUNDS * max(seconds_per_call, 1e-6))
    return max(CALLS, min(MAX_CALLS, math.ceil(wanted)))
