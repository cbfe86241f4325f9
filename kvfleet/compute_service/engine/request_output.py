"""What a request yields per step, and when it stops. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.core.allocator import Refusal
from kvfleet.core.sampling import SamplingParams


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    finished: bool = False
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error" (a step raised) once finished
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0               # prompt tokens served from the prefix cache
    refusal: Refusal | None = None       # why the engine aborted it: blocks refused (pool or quota)
    failure: str | None = None           # why the node gave it up (a step raised, or the node's own trouble)

    @property
    def error(self) -> str | None:
        return self.refusal.message() if self.refusal is not None else self.failure

    @classmethod
    def empty(cls, request_id: str) -> "RequestOutput":
        return cls(request_id)

    def merged(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by ``later``: tokens and text concatenated, figures from ``later``."""
        return replace(later, new_token_ids=self.new_token_ids + later.new_token_ids,
                       new_text=self.new_text + later.new_text)


class StopChecker:
    """EOS, ``max_tokens``, ``max_model_len`` and stop strings. Text that could be the start of a
    stop string is held back until it is known not to be one; a matched stop string is not emitted."""

    def __init__(self, sampling: SamplingParams, eos_token_ids: tuple[int, ...], max_model_len: int):
        self.sampling = sampling
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.hold = max((len(s) for s in sampling.stop), default=1) - 1
        self.pending = ""   # never holds a whole stop string

    def last_token(self, seq: Sequence, token: int) -> str | None:
        """"stop" (eos) or "length" when ``token`` (just appended to ``seq``) ends the output
        whatever its text; a stop string is found by ``check``."""
        if token in self.eos:
            return "stop"
        if seq.num_output_tokens >= self.sampling.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def check(self, seq: Sequence, token: int, text: str) -> tuple[str | None, str]:
        """(finish reason or None, the text to emit now)."""
        self.pending += text
        if self.sampling.stop:
            hits = [i for i in (self.pending.find(s) for s in self.sampling.stop) if i >= 0]
            if hits:
                return "stop", self.pending[:min(hits)]
        reason = self.last_token(seq, token)
        cut = len(self.pending) if reason else max(len(self.pending) - self.hold, 0)
        emit, self.pending = self.pending[:cut], self.pending[cut:]
        return reason, emit
