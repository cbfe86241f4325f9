"""Resume bookkeeping (pure): what the next node is asked for after a failure."""

from router.resume import Progress


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
    from router.resume import is_client_answer

    assert is_client_answer("INVALID_ARGUMENT") and is_client_answer("UNAUTHENTICATED")
    assert is_client_answer("RESOURCE_EXHAUSTED", "quota")   # the tenant's quota: every node says so
    assert not is_client_answer("RESOURCE_EXHAUSTED", "pool")  # this node is full: try another
    assert not is_client_answer("UNAVAILABLE") and not is_client_answer("INTERNAL")
