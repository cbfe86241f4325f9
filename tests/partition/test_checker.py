"""The partition checker on histories written by hand: each check finds what it is for and nothing
in a clean history."""

from __future__ import annotations

from kvfleet.cli.partition.checker import (
    QuotaSample,
    Stream,
    Write,
    check,
    double_grants,
    lost_acknowledged,
    over_quota,
    split_brain_writes,
    stall_thresholds,
    totals,
    unavailable_s,
    wrong_tokens,
)


def alloc(t, replica, seq, blocks, ok=True):
    return Write(t, t + 0.01, replica, "alloc", seq, ok, tuple(blocks))


def release(t, replica, seq, ok=True):
    return Write(t, t + 0.01, replica, "release", seq, ok)


def clean_history():
    """bs-a leads, is fenced (refuses), bs-b takes over; the standby refused all along until then."""
    writes = [alloc(0, "bs-a", "s0", [0]), alloc(0, "bs-b", "x0", [], ok=False),
              alloc(1, "bs-a", "s1", [1]), alloc(1, "bs-b", "x1", [], ok=False),
              alloc(2, "bs-a", "y2", [], ok=False), alloc(2, "bs-b", "y2b", [], ok=False),
              alloc(3, "bs-a", "y3", [], ok=False), alloc(3, "bs-b", "s3", [2]),
              release(4, "bs-a", "s0", ok=False), release(4, "bs-b", "s0"),
              alloc(5, "bs-a", "y5", [], ok=False), alloc(5, "bs-b", "s5", [0])]
    return writes, {"s1": [1], "s3": [2], "s5": [0]}


def test_a_clean_history_passes_every_check():
    writes, final = clean_history()
    streams = [Stream(0, 1, 0, [5, 6, 7], [0.5, 1]), Stream(1, 2, 1, [8], [1.5], error="UNAVAILABLE")]
    result = check(writes, final, streams, {0: [5, 6, 7], 1: [8, 9]}, [QuotaSample(0, "gold", "n", 3, 4)], 0, 5.5)
    assert {k: result[k] for k in ("lost_acknowledged", "double_grants", "split_brain_writes", "wrong_tokens",
                                   "over_quota")} == dict.fromkeys(
        ("lost_acknowledged", "double_grants", "split_brain_writes", "wrong_tokens", "over_quota"), 0)
    assert result["unavailable_by_client_s"] == {"page_table": 2.0, "streams": 4.0}  # acked at 1.01, then 3.01
    assert result["unavailable_raw_by_client_s"] == result["unavailable_by_client_s"]  # no delay: the same 1 s
    assert result["stall_s"] == {"page_table": 1.0, "streams": 1.0}
    assert result["acknowledged_writes"] == 5 and result["failed_streams"] == 1


def test_an_acknowledged_allocation_missing_after_the_heal_is_lost():
    writes, final = clean_history()
    assert lost_acknowledged(writes, {**final, "s1": []}) == ["s1"]
    assert lost_acknowledged(writes, {**final, "s1": [7]}) == ["s1"]       # other blocks than granted
    assert lost_acknowledged(writes, {k: v for k, v in final.items() if k != "s0"}) == []  # released
    unsure = [*writes, release(6, "bs-a", "s1", ok=False), release(6, "bs-b", "s1", ok=False)]
    assert lost_acknowledged(unsure, {**final, "s1": []}) == []            # a release that may have applied


def test_a_block_granted_twice_is_found_in_the_history_and_after_the_heal():
    writes, final = clean_history()
    twice = [*writes, alloc(6, "bs-b", "s6", [1])]                         # s1 still holds block 1
    assert double_grants(twice, {**final, "s6": [1]}) == [
        "block 1 granted to s6 while s1 held it", "block 1 held by s1 and s6 after the heal"]
    assert double_grants(writes, final) == []
    # a release that timed out may have been applied: its blocks are free from when it was sent
    unsure = [*writes, release(6, "bs-a", "s1", ok=False), release(6, "bs-b", "s1", ok=False),
              alloc(7, "bs-b", "s7", [1])]
    assert double_grants(unsure, {"s3": [2], "s5": [0], "s7": [1]}) == []


def test_a_deposed_leader_acknowledging_inside_the_new_leaders_term_is_split_brain():
    writes, _ = clean_history()
    late = alloc(6, "bs-a", "late", [9])
    more = [*writes, late, alloc(6, "bs-b", "s6", [3]), alloc(7, "bs-b", "s7", [4])]
    assert split_brain_writes(more) == [late]
    assert split_brain_writes(writes) == []
    # a handover back after a refusal of the other's is a new term, not a split brain
    back = [*writes, alloc(6, "bs-b", "z", [], ok=False), alloc(7, "bs-a", "s7", [5]), alloc(8, "bs-a", "s8", [6])]
    assert split_brain_writes(back) == []


def test_tokens_lost_repeated_or_wrong_are_counted():
    ref = {0: [1, 2, 3, 4]}
    assert wrong_tokens([Stream(0, 1, 0, [1, 2, 3, 4])], ref) == 0
    assert wrong_tokens([Stream(0, 1, 0, [1, 2, 2, 3, 4])], ref) == 3      # a repeat shifts the rest
    assert wrong_tokens([Stream(0, 1, 0, [1, 2, 4])], ref) == 2            # a lost token
    assert wrong_tokens([Stream(0, 1, 0, [1, 9, 3, 4])], ref) == 1
    assert wrong_tokens([Stream(0, 1, 0, [1, 2], error="UNAVAILABLE")], ref) == 0  # failed: a prefix is right
    assert wrong_tokens([Stream(0, 1, 0, [1, 5], error="UNAVAILABLE")], ref) == 1


def test_quota_and_unavailability():
    assert over_quota([QuotaSample(0, "t", "n", 5, 4), QuotaSample(1, "t", "n", 4, 4),
                       QuotaSample(2, "u", "n", 99, None)]) == 1
    assert unavailable_s([0.5, 1.0, 1.5, 4.0, 4.5], 0, 5) == 2.5           # 1.5 → 4.0 only
    assert unavailable_s([0.5, 1.0], 0, 4) == 3.0                          # still out at the end
    assert unavailable_s([], 0, 3) == 3.0 and unavailable_s([0.1, 0.9, 9], 0, 1) == 0.0


def test_a_delayed_scenario_allows_its_delay_once_per_leg_and_keeps_the_flat_figure():
    # every service's sends delayed 200 ms: a page-table answer needs 3 legs, a first token 9
    assert stall_thresholds(0.2) == {"page_table": 1.0 + 3 * 0.2, "streams": 1.0 + 9 * 0.2}
    writes = [alloc(t, "bs-a", f"s{i}", [i]) for i, t in enumerate([0.0, 1.5, 3.0, 6.0])]  # acks 0.01 ... 6.01
    streams = [Stream(0, 6.3, 0, [5] * 4, [2.5, 5.0, 5.1, 6.2])]  # first token after 2.5 s, then 2.5 and 1.1
    result = check(writes, {f"s{i}": [i] for i in range(4)}, streams, {0: [5] * 4}, [], 0, 6.5, delay_s=0.2)
    assert result["unavailable_by_client_s"] == {"page_table": 3.0, "streams": 0.0}  # only 3.01 → 6.01 past 1.6 s
    assert result["unavailable_raw_by_client_s"] == {"page_table": 1.5 + 1.5 + 3.0, "streams": 2.5 + 2.5 + 1.1}
    assert result["unavailable_s"] == 3.0 and result["unavailable_raw_s"] == 6.1
    assert result["stall_s"] == {"page_table": 1.6, "streams": 2.8}


def test_totals_sum_each_figure_over_the_scenarios():
    a = {"lost_acknowledged": 1, "double_grants": 0, "split_brain_writes": 2, "wrong_tokens": 0, "over_quota": 0,
         "unavailable_s": 1.5, "unavailable_raw_s": 2.0}
    assert totals({"a": a, "b": {**a, "unavailable_s": 2.25, "unavailable_raw_s": 3.0}}) == {
        "lost_acknowledged": 2, "double_grants": 0, "split_brain_writes": 4, "wrong_tokens": 0, "over_quota": 0,
        "unavailable_s": 3.75, "unavailable_raw_s": 5.0}


def test_each_violation_carries_its_records_with_times_and_terms():
    writes, final = clean_history()
    twice = [*writes, alloc(6, "bs-b", "s6", [1])]                         # s1 still holds block 1
    result = check(twice, {**final, "s6": [1]}, [], {}, [], 0, 7)
    [granted, held] = result["violations"]["double_grants"]
    assert granted["what"] == "block 1 granted to s6 while s1 held it"
    assert [(r["replica"], r["op"], r["seq_id"], r["ok"], r["block_ids"]) for r in granted["records"]] == [
        ("bs-a", "alloc", "s1", True, (1,)), ("bs-b", "alloc", "s6", True, (1,))]
    assert granted["records"][0]["term"] == [0.01, 1] and granted["records"][1]["term"] == [3.01, 6]
    assert held["records"] == granted["records"]
    lost = check(writes, {**final, "s1": []}, [], {}, [], 0, 7)["violations"]["lost_acknowledged"]
    assert [r["seq_id"] for r in lost[0]["records"]] == ["s1"] and lost[0]["what"] == "s1"


def test_an_acknowledged_grant_the_new_leader_never_had_is_lost_and_granted_twice():
    """The shape of issue 34's finding: the deposed leader acknowledged ``x`` (block 3); the new leader
    never had it and granted block 3 to ``y``; ``x``'s release, refused by the deposed leader and
    answered NotFound by the new one, is not an uncertain release but proof that ``x`` was gone."""
    writes = [alloc(0, "bs-a", "s0", [0]), alloc(0, "bs-b", "n0", [], ok=False),
              alloc(1, "bs-a", "x", [3]), alloc(1, "bs-b", "n1", [], ok=False),
              alloc(2, "bs-a", "d2", [], ok=False), alloc(2, "bs-b", "n2", [], ok=False),
              alloc(3, "bs-a", "d3", [], ok=False), alloc(3, "bs-b", "y", [3]),
              Write(4, 4.01, "bs-a", "release", "x", False, error="Unavailable"),
              Write(4, 4.01, "bs-b", "release", "x", False, error="NotFound")]
    final = {"s0": [0], "y": [3]}
    assert lost_acknowledged(writes, final) == ["x (its release found it gone)"]
    assert double_grants(writes, final) == ["block 3 granted to y while x held it"]
    timed_out = [*writes[:-2], Write(4, 4.01, "bs-a", "release", "x", False, error="Unavailable"),
                 Write(4, 4.01, "bs-b", "release", "x", False, error="DeadlineExceeded")]
    assert lost_acknowledged(timed_out, final) == []                       # may have been applied: uncertain
