"""The id rule (pure): every id a request gets inside the cluster fits the one limit."""

import pytest

from kvfleet.core.errors import InvalidArgument
from kvfleet.core.ids import MAX_ATTEMPTS, MAX_ID_LEN, MAX_REQUEST_ID_LEN, attempt_id, check_id, seq_id_of


def test_the_last_attempt_of_the_longest_request_id_is_exactly_the_limit():
    seq_id = seq_id_of("r" * MAX_REQUEST_ID_LEN)
    assert seq_id.startswith("r" * MAX_REQUEST_ID_LEN + "-") and seq_id != seq_id_of("r" * MAX_REQUEST_ID_LEN)
    ids = [attempt_id(seq_id, n) for n in range(MAX_ATTEMPTS)]
    assert ids[0] == seq_id and ids[1] == f"{seq_id}.1" and len(set(ids)) == MAX_ATTEMPTS
    assert max(len(check_id("seq_id", i)) for i in ids) == MAX_ID_LEN


def test_what_does_not_fit_is_refused_where_it_is_made():
    with pytest.raises(ValueError, match="request id"):
        seq_id_of("r" * (MAX_REQUEST_ID_LEN + 1))
    with pytest.raises(ValueError, match="attempt"):
        attempt_id("s", MAX_ATTEMPTS)
    with pytest.raises(InvalidArgument, match="seq_id"):
        check_id("seq_id", "x" * (MAX_ID_LEN + 1))
