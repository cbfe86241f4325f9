"""A public ``GenerateRequest`` checked and turned into what the cluster runs.

Every mistake raises ``InvalidRequest`` naming the field (→ INVALID_ARGUMENT). Proto3 cannot tell an
unset number from zero, so the public API's zero values mean "off": ``top_p`` 0 → 1 (disabled),
``seed`` 0 → no seed; ``max_tokens`` has no sensible "off" and must be at least 1.
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass
from typing import Protocol

from compute_service.sampling import SamplingParams

MAX_REQUEST_ID_LEN = 100  # + a 9-character suffix, within block_service's 128 for sequence ids
MAX_PROMPT_CHARS = 4 << 20


class InvalidRequest(ValueError):
    """A field of the request is wrong; the message says which and why."""


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(slots=True, frozen=True)
class ParsedRequest:
    request_id: str          # the client's (or a generated) id, echoed in every chunk
    seq_id: str              # the id inside the cluster: unique even when two tenants reuse a request_id
    prompt_ids: list[int]
    sampling: SamplingParams


def _request_id(value: str) -> str:
    if not value:
        return uuid.uuid4().hex
    if len(value) > MAX_REQUEST_ID_LEN or not value.isprintable():
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_LEN} printable characters")
    return value


def sampling_from_proto(s) -> SamplingParams:
    """``kvfleet.v1.SamplingParams`` → ``SamplingParams``; raises InvalidRequest."""
    if s.max_tokens < 1:
        raise InvalidRequest("sampling.max_tokens must be at least 1")
    for name in ("temperature", "top_p"):
        if not math.isfinite(getattr(s, name)):
            raise InvalidRequest(f"sampling.{name} must be a finite number")
    if s.temperature < 0:
        raise InvalidRequest(f"sampling.temperature must be >= 0 (0 = greedy), got {s.temperature}")
    if not 0.0 <= s.top_p <= 1.0:
        raise InvalidRequest(f"sampling.top_p must be in [0, 1] (0 or 1 = disabled), got {s.top_p}")
    try:
        return SamplingParams(
            max_tokens=int(s.max_tokens),
            temperature=float(s.temperature),
            top_p=float(s.top_p) if s.top_p > 0 else 1.0,
            top_k=int(s.top_k),
            seed=int(s.seed) if s.seed else None,
            stop=tuple(s.stop),
            ignore_eos=bool(s.ignore_eos),
        )
    except ValueError as e:
        raise InvalidRequest(f"sampling: {e}") from None


def sampling_to_proto(p: SamplingParams, message) -> None:
    """Fill the ``kvfleet.v1.SamplingParams`` ``message`` from ``p``."""
    message.max_tokens = p.max_tokens
    message.temperature = p.temperature
    message.top_p = p.top_p
    message.top_k = p.top_k
    message.seed = p.seed or 0
    message.stop[:] = list(p.stop)
    message.ignore_eos = p.ignore_eos


def parse_request(req, tokenizer: TextTokenizer) -> ParsedRequest:
    """Check a ``kvfleet.v1.GenerateRequest`` and tokenize its prompt."""
    request_id = _request_id(req.request_id)
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt is missing: set either text or tokens")
    if which == "text":
        if not req.text:
            raise InvalidRequest("prompt text is empty")
        if len(req.text) > MAX_PROMPT_CHARS:
            raise InvalidRequest(f"prompt text is longer than {MAX_PROMPT_CHARS} characters")
        ids = tokenizer.encode(req.text)
        if not ids:
            raise InvalidRequest("prompt text encodes to no tokens")
    else:
        ids = list(req.tokens.ids)
        if not ids:
            raise InvalidRequest("prompt tokens are empty")
        bad = next((t for t in ids if t >= tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
    if not req.HasField("sampling"):
        raise InvalidRequest("sampling is missing: at least sampling.max_tokens must be set")
    seq_id = f"{request_id}-{secrets.token_hex(4)}"
    return ParsedRequest(request_id, seq_id, ids, sampling_from_proto(req.sampling))
