"""Swap or recompute (pure): the cost comparison, the modes, and the flags' checks."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.engine.swap_cost import SwapCost, parse_preemption_mode, should_swap
from kvfleet.compute_service.kv.tier_flags import check_tier_flags

FAST_COPIES = SwapCost(out_bytes_per_s=1e9, in_bytes_per_s=1e9, prefill_tokens_per_s=1000)


def test_swap_wins_when_copying_both_ways_is_cheaper_than_prefilling():
    # 1 MB out and back: 2 ms; 100 tokens at 1000/s: 100 ms
    assert should_swap("auto", FAST_COPIES, 10**6, 100, has_room=True)
    # 100 MB out and back: 200 ms > 100 ms
    assert not should_swap("auto", FAST_COPIES, 10**8, 100, has_room=True)
    assert FAST_COPIES.swap_seconds(10**6) == pytest.approx(0.002)
    assert FAST_COPIES.recompute_seconds(100) == pytest.approx(0.1)


def test_asymmetric_bandwidth_counts_each_direction():
    cost = SwapCost(out_bytes_per_s=1e6, in_bytes_per_s=1e9, prefill_tokens_per_s=1000)
    assert cost.swap_seconds(10**6) == pytest.approx(1.001)
    assert not should_swap("auto", cost, 10**6, 1000, has_room=True)  # 1.001 s > 1 s
    assert should_swap("auto", cost, 10**6, 1002, has_room=True)


def test_modes_and_room():
    assert should_swap("swap", None, 10**12, 1, has_room=True)
    assert not should_swap("swap", FAST_COPIES, 1, 100, has_room=False)
    assert not should_swap("recompute", FAST_COPIES, 1, 10**6, has_room=True)
    assert not should_swap("auto", None, 1, 10**6, has_room=True)  # nothing measured: recompute
    assert not should_swap("auto", FAST_COPIES, 0, 0, has_room=True)


def test_bad_rates_and_modes_are_refused():
    with pytest.raises(ValueError):
        SwapCost(0, 1, 1)
    with pytest.raises(ValueError, match="--preemption-mode"):
        parse_preemption_mode("sometimes")


@pytest.mark.parametrize("flags, words", [
    ((-1, None, 0, "auto"), ">= 0 bytes"),
    ((1 << 20, "/tmp/x", 0, "auto"), "go together"),
    ((1 << 20, None, 1 << 20, "auto"), "go together"),
    ((0, "/tmp/x", 1 << 20, "auto"), "needs --kv-host-memory"),
    ((0, None, 0, "swap"), "needs --kv-host-memory"),
    ((1 << 62, None, 0, "auto"), "more than this machine's memory"),
    ((1 << 20, None, 0, "never"), "--preemption-mode"),
])
def test_tier_flags_that_cannot_work_are_refused_in_one_line(flags, words):
    with pytest.raises(ValueError, match=words) as info:
        check_tier_flags(*flags)
    assert "\n" not in str(info.value)


def test_a_disk_dir_that_is_a_file_or_under_one_is_refused(tmp_path):
    afile = tmp_path / "f"
    afile.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        check_tier_flags(1 << 20, str(afile), 1 << 20, "auto")
    with pytest.raises(ValueError, match="cannot be created"):
        check_tier_flags(1 << 20, str(afile / "kv"), 1 << 20, "auto")
    check_tier_flags(1 << 20, str(tmp_path / "new" / "kv"), 1 << 20, "auto")  # created at start: fine
