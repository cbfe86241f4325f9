"""A public ``GenerateRequest`` checked and turned into what the cluster runs.

Every mistake raises ``InvalidRequest`` naming the field (→ INVALID_ARGUMENT); sampling fields are
converted by ``kvfleet.wire`` (shared with the compute nodes). A client's request id is at most
``MAX_REQUEST_ID_LEN`` characters: with the suffix that makes it a sequence id it must fit the one
id limit every service shares (``kvfleet/ids.py``).
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Protocol

from kvfleet.ids import MAX_REQUEST_ID_LEN, SEQ_SUFFIX_HEX
from kvfleet.sampling import SamplingParams
from kvfleet.wire import InvalidRequest, sampling_from_proto

MAX_PROMPT_CHARS = 4 << 20


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(slots=True, frozen=True)
class ModelVocabulary:
    """The tokenizer's encoder with the MODEL's vocabulary size (config.json): a model may embed more
    ids than its tokenizer produces (padded embeddings), and those are valid prompt tokens, while an
    id past the embedding is not, whatever the tokenizer knows."""

    tokenizer: TextTokenizer
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)


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
    seq_id = f"{request_id}-{secrets.token_hex(SEQ_SUFFIX_HEX // 2)}"
    return ParsedRequest(request_id, seq_id, ids, sampling_from_proto(req.sampling))
