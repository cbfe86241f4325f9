"""The thread probe on real torch layers: it times the model's widest linear layer at both counts
and applies the governor's answer; a layer that cannot take the probe turns probing off."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvfleet.compute_service.engine.thread_governor import ThreadGovernor
from kvfleet.compute_service.engine.thread_probe import CALLS, MAX_CALLS, ThreadProbe, calls_for


class _Refusing(nn.Linear):
    def forward(self, x):
        raise RuntimeError("no rows of that dtype here")


def test_the_probe_times_both_counts_and_sets_the_chosen_one():
    before = torch.get_num_threads()
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(64, 256), nn.Linear(64, 256), nn.Linear(256, 4096))
        probe = ThreadProbe(model, torch.float32, ThreadGovernor((1, 2), first_probe_s=0.0))
        assert probe._layer[0] is model[1]  # the widest that recurs, not the head
        probe.maybe_probe()
        assert sum(probe.governor.chosen.values()) == 1
        assert torch.get_num_threads() == probe.governor.current
        assert CALLS <= probe.calls <= MAX_CALLS  # sized from the first probe's calls to last MIN_PROBE_S
        probe.maybe_probe()  # not due again so soon
        assert sum(probe.governor.chosen.values()) == 1
    finally:
        torch.set_num_threads(before)


def test_a_failing_probe_turns_probing_off_and_keeps_the_count(caplog):
    before = torch.get_num_threads()
    try:
        probe = ThreadProbe(nn.Sequential(_Refusing(8, 8)), torch.float32, ThreadGovernor((1, 2), first_probe_s=0.0))
        with caplog.at_level(logging.WARNING):
            probe.maybe_probe()
        assert "thread probe failed, staying at 1 threads" in caplog.text
        assert torch.get_num_threads() == 1 and probe._layer is None
        probe.maybe_probe()  # off: nothing happens
    finally:
        torch.set_num_threads(before)


def test_a_probe_lasts_long_enough_for_a_moments_noise_not_to_decide():
    assert calls_for(0.57e-3) == 12  # SmolLM2's MLP in bfloat16: 3 rounds of 12 calls, 20 ms at one thread
    assert calls_for(10e-3) == CALLS  # a wide layer: the fewest calls
    assert calls_for(1e-9) == MAX_CALLS  # a tiny one: no more than the most
