"""The judge of the chaos suite, judged: pure, milliseconds, no cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from chaos_outcomes import (
    CANCELLED,
    NO_FAULT,
    OK,
    FaultPolicy,
    Outcome,
    RequestSpec,
    Tally,
    status_violation,
    token_violation,
    violations,
)

REF = [5, 6, 7, 8, 9, 10]
SPEC = RequestSpec("stream", "sk-gold", "p0", 4)
OUTAGE = FaultPolicy("outage", "test", excused=frozenset({"UNAVAILABLE"}), start=10.0, end=20.0)


def outcome(code=OK, tokens=(5, 6, 7, 8), finish="LENGTH", sent=0.0, ended=1.0, cancelled=False, spec=SPEC):
    return Outcome(spec, code, list(tokens), finish, "why", sent, ended, cancelled)


def test_a_finished_stream_with_the_reference_tokens_passes():
    assert status_violation(outcome()) is None
    assert token_violation(outcome(), REF) is None


@pytest.mark.parametrize("tokens, where", [
    ((5, 7, 8, 9), "first difference at 1"),      # a token lost: the rest shifts
    ((5, 6, 6, 7), "first difference at 2"),      # a token repeated
    ((5, 6, 7), "3 tokens against 4"),            # finished short
    ((5, 6, 7, 8, 9), "5 tokens against 4"),      # one too many
])
def test_a_lost_or_duplicated_token_is_found(tokens, where):
    assert where in token_violation(outcome(tokens=tokens), REF)


def test_an_unfinished_stream_must_be_a_prefix_of_the_reference():
    assert token_violation(outcome(CANCELLED, (5, 6), "", cancelled=True), REF) is None
    assert "first difference at 1" in token_violation(outcome(CANCELLED, (5, 9), "", cancelled=True), REF)


def test_a_finished_stream_without_length_finish_is_wrong():
    assert "finished STOP" in token_violation(outcome(finish="STOP"), REF)


def test_cancelled_is_allowed_only_for_the_clients_own_cancel():
    assert status_violation(outcome(CANCELLED, (), "", cancelled=True)) is None
    assert "did not cancel" in status_violation(outcome(CANCELLED, (), "", cancelled=False))


def test_undocumented_statuses_are_never_allowed():
    assert "not a documented status" in status_violation(outcome("UNKNOWN", ()))
    assert "not a documented status" in status_violation(outcome("HUNG", ()), OUTAGE)


def test_a_fault_excuses_its_codes_only_inside_its_window_and_before_the_first_token():
    assert status_violation(outcome("UNAVAILABLE", (), sent=12, ended=13), OUTAGE) is None
    assert status_violation(outcome("UNAVAILABLE", (), sent=5, ended=11), OUTAGE) is None    # overlaps
    assert status_violation(outcome("UNAVAILABLE", (), sent=21, ended=22), OUTAGE) is not None  # after
    assert status_violation(outcome("UNAVAILABLE", (5,), sent=12, ended=13), OUTAGE) is not None  # mid-stream
    assert status_violation(outcome("RESOURCE_EXHAUSTED", (), sent=12, ended=13), OUTAGE) is not None
    assert status_violation(outcome("UNAVAILABLE", ())) is not None  # no fault, no excuse


def test_mid_stream_excuses_and_windows_are_the_policys():
    door = FaultPolicy("door", "test", excused=frozenset({"UNAVAILABLE"}), mid_stream=True).within(10, 20)
    assert status_violation(outcome("UNAVAILABLE", (5, 6), sent=12, ended=13), door) is None
    assert status_violation(outcome("UNAVAILABLE", (5, 6), sent=30, ended=31), door) is not None


def test_specs_and_policies_allow_only_documented_answers():
    with pytest.raises(AssertionError):
        RequestSpec("x", "k", "p", 1, frozenset({"UNKNOWN"}))
    with pytest.raises(AssertionError):
        RequestSpec("x", "k", "p", 1, frozenset({CANCELLED}))
    with pytest.raises(AssertionError):
        FaultPolicy("x", "y", excused=frozenset({"INTERNAL"}))


def test_alike_violations_collapse_into_one_counted_line():
    found = violations([outcome("UNKNOWN", ())] * 3 + [outcome(tokens=(5, 6, 6, 7))], {"p0": REF}, NO_FAULT)
    assert len(found) == 2
    assert found[0].startswith("3 × stream requests ended UNKNOWN")
    assert found[1].startswith("1 × stream requests (OK) got other tokens")


def test_requests_without_a_reference_are_judged_on_status_only():
    fuzz = RequestSpec("fuzz", "sk-gold", "", 0, frozenset({"INVALID_ARGUMENT"}))
    assert violations([outcome("INVALID_ARGUMENT", (), "", spec=fuzz)], {"p0": REF}) == []


def test_the_tally_counts_per_kind_and_status():
    tally = Tally()
    tally.add([outcome(), outcome(), outcome(CANCELLED, (5,), "", cancelled=True)])
    assert tally.total == 3 and tally.tokens == 9
    assert tally.per_status() == {CANCELLED: 1, OK: 2}
    assert tally.table().splitlines()[-1].split() == ["all", "1", "2"]


@pytest.mark.process
def test_the_judge_imports_neither_grpc_nor_torch():
    here = Path(__file__).parent
    code = "import sys, chaos_outcomes; bad = {'grpc', 'torch'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], cwd=here, check=True)


def test_any_of_several_faults_may_excuse():
    later = OUTAGE.within(30, 40)
    assert status_violation(outcome("UNAVAILABLE", (), sent=31, ended=32), [OUTAGE, later]) is None
    assert status_violation(outcome("UNAVAILABLE", (), sent=25, ended=26), [OUTAGE, later]) is not None
