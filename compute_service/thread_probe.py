"""Times one of the model's own linear layers at each intra-op thread count the governor weighs
(``thread_governor.py``) and sets torch's count to its answer. Runs on the engine's step thread,
between steps. The layer is the widest of those every decoder layer has (an MLP projection), not
the output head, which is several times larger on a real vocabulary: on bench-small a probe of
the head (64 rows, 12 calls per count) took 73 ms in float32, 7 % of the engine's time at one
probe a second; as it is now (its MLP projection, 32 rows, 6 calls per count) 22 ms in float32 and
9 ms in bfloat16."""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch
from torch import nn

from compute_service.thread_governor import ThreadGovernor

log = logging.getLogger(__name__)

PROBE_ROWS = 32   # a decode batch's rows; a row count the packed layers were warmed up for
ROUNDS, CALLS = 2, 3  # rounds alternate the candidates; each round times CALLS calls per candidate


class ThreadProbe:
    def __init__(self, model: nn.Module, dtype: torch.dtype, governor: ThreadGovernor):
        """``dtype``: the model's activations'; the probe feeds its layer rows of it."""
        self.governor = governor
        self._layer = _widest_linear(model, dtype) if governor.adaptive else None
        torch.set_num_threads(governor.current)

    def maybe_probe(self) -> None:
        """Probe if it is time; a probe that fails turns probing off (with a warning) and leaves
        the count as it is: the engine serves on, at the count it had."""
        now = time.monotonic()
        if self._layer is None or not self.governor.due(now):
            return
        try:
            self._probe(now)
        except Exception as e:  # a layer that cannot take the probe's rows: keep serving without it
            log.warning("intra-op thread probe failed, staying at %d threads: %s", self.governor.current, e)
            self._layer = None
            torch.set_num_threads(self.governor.current)

    def _probe(self, now: float) -> None:
        layer, x = self._layer
        seconds = dict.fromkeys(self.governor.candidates, 0.0)
        with torch.inference_mode():
            for _ in range(ROUNDS):
                for threads in seconds:
                    torch.set_num_threads(threads)
                    started = time.perf_counter()
                    for _ in range(CALLS):
                        layer(x)
                    seconds[threads] += time.perf_counter() - started
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
