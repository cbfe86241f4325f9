"""A public ``GenerateRequest`` checked and turned into what the cluster runs.

Every mistake raises ``InvalidRequest`` naming the field (→ INVALID_ARGUMENT); sampling fields are
converted by ``kvfleet.core.wire`` (shared with the compute nodes). A client's request id is at most
``MAX_REQUEST_ID_LEN`` characters: ``kvfleet/core/ids.py`` budgets the suffixes of its sequence and
attempt ids into that, so every id a node sees fits the one limit every service shares.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Protocol

from kvfleet.core.ids import MAX_REQUEST_ID_LEN, seq_id_of
from kvfleet.core.sampling import SamplingParams
from kvfleet.core.wire import InvalidRequest, sampling_from_proto
from kvfleet.router.chat_template import ChatMessage, ChatTemplate
from kvfleet.router.pinning import PinAsk, pin_from_proto

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
    stop_token_ids: frozenset[int] = frozenset()  # the model's end-of-turn tokens (none with ignore_eos)
    pin: PinAsk | None = None  # cache.pin: pin the prompt on the node chosen (``kvfleet/router/pinning.py``)


def _request_id(value: str) -> str:
    if not value:
        return uuid.uuid4().hex
    if len(value) > MAX_REQUEST_ID_LEN or not value.isprintable():
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_LEN} printable characters")
    return value


def _encode(text: str, tokenizer: TextTokenizer, what: str) -> list[int]:
    if len(text) > MAX_PROMPT_CHARS:
        raise InvalidRequest(f"{what} is longer than {MAX_PROMPT_CHARS} characters")
    ids = tokenizer.encode(text)
    if not ids:
        raise InvalidRequest(f"{what} encodes to no tokens")
    return ids


def parse_request(req, tokenizer: TextTokenizer, chat: ChatTemplate | None = None,
                  end_of_turn: frozenset[int] = frozenset()) -> ParsedRequest:
    """Check a ``kvfleet.v1.GenerateRequest`` and tokenize its prompt; a chat is rendered with the
    model's template ``chat`` first. Generation stops at the ``end_of_turn`` tokens unless
    ``sampling.ignore_eos``."""
    request_id = _request_id(req.request_id)
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidRequest("prompt is missing: set text, tokens or chat")
    if which == "text":
        if not req.text:
            raise InvalidRequest("prompt text is empty")
        ids = _encode(req.text, tokenizer, "prompt text")
    elif which == "chat":
        messages = [ChatMessage(m.role, m.content) for m in req.chat.messages]
        if chat is None:
            chat = ChatTemplate(None)
        ids = _encode(chat.render(messages), tokenizer, "chat.messages rendered by the chat template")
    else:
        ids = list(req.tokens.ids)
        if not ids:
            raise InvalidRequest("prompt tokens are empty")
    bad = next((t for t in ids if t >= tokenizer.vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
    if not req.HasField("sampling"):
        raise InvalidRequest("sampling is missing: at least sampling.max_tokens must be set")
    sampling = sampling_from_proto(req.sampling)
    return ParsedRequest(request_id, seq_id_of(request_id), ids, sampling,
                         frozenset() if sampling.ignore_eos else end_of_turn, pin_from_proto(req))
