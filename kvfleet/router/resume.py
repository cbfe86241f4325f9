"""What a request has been through on its way across nodes: the bookkeeping that lets the router
retry before the first token and resume mid-stream with every token sent exactly once. Pure.

    attempt 0 on node a: prompt                 -> tokens t1 t2 t3, then a dies
    attempt 1 on node b: prompt + t1 t2 t3      -> tokens t4 ... (max_tokens - 3 of them)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfleet.core import ids

# What a node answers that is the request's own outcome, to pass on to the client as it is: the
# request is wrong or not allowed, and another node would say the same. (gRPC status names.)
CLIENT_ANSWERS = frozenset({"INVALID_ARGUMENT", "PERMISSION_DENIED", "NOT_FOUND", "UNAUTHENTICATED"})


def is_client_answer(status: str, refusal: str = "") -> bool:
    """True when a node's error ends the request; False when another node should try. A block
    refusal is the client's unless it is a full pool (a quota is the tenant's; a pool is the node's)."""
    return status in CLIENT_ANSWERS or (status == "RESOURCE_EXHAUSTED" and refusal != "pool")


@dataclass(slots=True)
class Progress:
    prompt_ids: list[int]
    max_tokens: int
    sent: list[int] = field(default_factory=list)  # tokens relayed to the client, in order
    cached_tokens: int | None = None               # as reported by the first node that served the prompt
    excluded: set[str] = field(default_factory=set)  # nodes that failed this request
    attempts: int = 0                              # attempts ended so far (failed, or handed over)
    source: str = ""                               # the prefill node holding the prompt's KV, once handed over
    last_failure: str = ""                         # what the last failed node said, for the client's error
    last_status: str = ""                          # its gRPC status name ("" when its stream broke or stalled)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.sent)

    @property
    def next_prompt(self) -> list[int]:
        """What the next node is given: the prompt and every token already sent."""
        return self.prompt_ids + self.sent

    def attempt_id(self, seq_id: str) -> str:
        """A fresh id per attempt: the failed node's sequence may still be live in block_service."""
        return ids.attempt_id(seq_id, self.attempts)

    def relayed(self, token_ids: Sequence[int], cached_tokens: int | None) -> None:
        if self.cached_tokens is None and cached_tokens is not None:
            self.cached_tokens = min(cached_tokens, len(self.prompt_ids))
        self.sent.extend(token_ids)

    def handed_over(self, node_id: str) -> None:
        """``node_id`` prefilled the prompt and sent the first token: the next attempt continues
        from there (a fresh attempt id) and fetches the prompt's KV from it."""
        self.source = node_id
        self.attempts += 1

    def failed(self, node_id: str, failure: str = "", status: str = "") -> None:
        self.excluded.add(node_id)
        self.attempts += 1
        self.last_failure, self.last_status = failure, status

    def given_up_status(self) -> str:
        """The status a client gets when no node is left to try: INTERNAL when the last node's
        engine raised (the error is the engine's, and it is in the message), else UNAVAILABLE."""
        return "INTERNAL" if self.last_status == "INTERNAL" else "UNAVAILABLE"
