"""A request's queue and prefill times on the node (pure; the engine's wiring is tested with a model)."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.engine.request_phases import RequestPhases
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.core.sampling import SamplingParams


def test_queue_is_arrival_to_first_step_and_prefill_is_first_step_to_first_token():
    phases = RequestPhases()
    seq = Sequence("a", [1, 2, 3], SamplingParams(), arrival_s=10.0)
    phases.scheduled([seq], 10.4)
    phases.scheduled([seq], 10.9)            # its next chunk: the first step stays
    phases.first_token(seq, 11.5)
    queue, prefill = phases.snapshots()
    assert (queue.count, prefill.count) == (1, 1)
    assert queue.sum == pytest.approx(0.4) and prefill.sum == pytest.approx(1.1)
