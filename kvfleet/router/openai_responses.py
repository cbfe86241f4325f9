"""The bodies the OpenAI door answers with, built from the public API's chunks. Pure.

    non-streaming:  one ``text_completion`` / ``chat.completion`` object with ``usage``
    streaming:      ``data: <chunk>`` events (a chat's first delta carries the role), the last
                    with ``finish_reason``; with ``stream_options.include_usage`` every chunk has
                    ``"usage": null`` and one more chunk with no choices carries the usage; then
                    ``data: [DONE]``

``usage.prompt_tokens_details.cached_tokens`` is the prompt tokens served from the prefix cache.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

FINISH_REASONS = {"FINISH_REASON_STOP": "stop", "FINISH_REASON_LENGTH": "length", "FINISH_REASON_ABORT": "abort"}
DONE = b"data: [DONE]\n\n"


@dataclass(slots=True, frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    pinned_tokens: int | None = None  # the prompt tokens a kvfleet_pin pinned (None: none pinned)

    def body(self) -> dict:
        body = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.pinned_tokens is not None:
            body["kvfleet_pinned_tokens"] = self.pinned_tokens
        return body


def sse(body: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class Answer:
    """One request's answer in OpenAI's shape: ``kind`` is "completion" or "chat"."""

    def __init__(self, kind: str, request_id: str, model: str, include_usage: bool = False,
                 clock=time.time):
        self.kind = kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(clock())
        self._role_sent = False

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def complete(self, text: str, finish_reason: str, usage: Usage) -> dict:
        """The whole answer (``stream: false``)."""
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": finish_reason, "logprobs": None}
            body = self._envelope("chat.completion", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "finish_reason": finish_reason,
                                                        "logprobs": None}])
        body["usage"] = usage.body()
        return body

    def delta(self, text: str, finish_reason: str | None = None) -> dict:
        """One streamed chunk."""
        if self.kind == "chat":
            delta = {"content": text}
            if not self._role_sent:
                delta = {"role": "assistant", **delta}
                self._role_sent = True
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": text, "finish_reason": finish_reason,
                                                        "logprobs": None}])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict:
        """The extra last chunk of ``stream_options.include_usage``."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": usage.body()}
