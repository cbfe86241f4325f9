"""Resume bookkeeping (pure): what the next node is asked for after a failure."""

from kvfleet.router.resume import Progress


def test_resume_asks_for_what_is_still_owed_with_a_fresh_id():
    progress = Progress(prompt_ids=[1, 2], max_tokens=5)
    assert (progress.next_prompt, progress.remaining, progress.attempt_id("r")) == ([1, 2], 5, "r")
    progress.relayed([7], cached_tokens=16)    # a node may count more cached tokens than the prompt had
    progress.relayed([8, 9], cached_tokens=0)  # later reports do not overwrite the first
    progress.failed("a")
    assert progress.next_prompt == [1, 2, 7, 8, 9] and progress.remaining == 2
    assert progress.attempt_id("r") == "r.1" and progress.excluded == {"a"}
    assert progress.cached_tokens == 2


def test_which_node_errors_are_the_clients_answer():
    from kvfleet.router.resume import is_client_answer

    assert is_client_answer("INVALID_ARGUMENT") and is_client_answer("UNAUTHENTICATED")
    assert is_client_answer("RESOURCE_EXHAUSTED", "quota")   # the tenant's quota: every node says so
    assert not is_client_answer("RESOURCE_EXHAUSTED", "pool")  # this node is full: try another
    assert not is_client_answer("UNAVAILABLE") and not is_client_answer("INTERNAL")


def test_the_longest_request_id_fits_a_node_on_every_attempt():
    """A 119-character request id (the old public limit) became a 130-character attempt id on its
    first resume; the node refused it with INVALID_ARGUMENT, which the router passed on to the
    client as the request's own answer instead of resuming it."""
    from kvfleet.core.ids import MAX_ATTEMPTS, MAX_ID_LEN, MAX_REQUEST_ID_LEN, check_id
    from kvfleet.router.request import parse_request
    from tests.router.test_request_parsing import ByteTokenizer, req

    parsed = parse_request(req(text="x", request_id="r" * MAX_REQUEST_ID_LEN), ByteTokenizer())
    progress = Progress(parsed.prompt_ids, max_tokens=8)
    lengths = []
    for attempt in range(MAX_ATTEMPTS):
        lengths.append(len(check_id("request_id", progress.attempt_id(parsed.seq_id))))
        progress.failed(f"node-{attempt}")
    assert max(lengths) == MAX_ID_LEN  # the budget is spent exactly, on the last attempt


def test_a_relay_allows_no_more_attempts_than_the_id_budget():
    import pytest

    from kvfleet.core.ids import MAX_ATTEMPTS
    from kvfleet.router.relay import Relay

    with pytest.raises(ValueError, match="max_attempts"):
        Relay(None, None, None, max_attempts=MAX_ATTEMPTS + 1)
