"""Ids, one rule for all: every id block_service stores or a node serves (node, tenant, sequence,
attempt) is a non-empty string of at most ``MAX_ID_LEN`` characters.

The router turns a client's request id into a sequence id once per request (a random suffix, so two
tenants reusing a request id never collide), and each resumed attempt on another node adds an
attempt number to that (the failed node's sequence may still be live in block_service)::

    request_id   "-" 8 hex digits   "." attempt (1 .. MAX_ATTEMPTS - 1; none on the first attempt)
    └─ at most MAX_REQUEST_ID_LEN ─┘
    └────────── seq_id ───────────┘
    └──────────────────── attempt id: at most MAX_ID_LEN ──────────────────────┘

Both suffixes are budgeted here, so the longest request id a client may send still fits on its last
resume; ``MAX_REQUEST_ID_LEN`` is the public limit, derived, never written anywhere else.
"""

from __future__ import annotations

import secrets

from kvfleet.core.errors import InvalidArgument

MAX_ID_LEN = 128
SEQ_SUFFIX_HEX = 8        # random hex digits of a sequence id's suffix
MAX_ATTEMPTS = 10         # attempts at one request: the first and up to nine resumes

SEQ_SUFFIX_LEN = 1 + SEQ_SUFFIX_HEX                  # "-" + hex
ATTEMPT_SUFFIX_LEN = 1 + len(str(MAX_ATTEMPTS - 1))  # "." + the last attempt's number
MAX_REQUEST_ID_LEN = MAX_ID_LEN - SEQ_SUFFIX_LEN - ATTEMPT_SUFFIX_LEN

# A node's sequence that holds the blocks of a KV fetch from a peer while they arrive (never a
# request's: request sequence ids end in the router's suffix), so block_service can show transfers.
FETCH_SEQ_PREFIX = "kv-fetch-"


def is_fetch(seq_id: str) -> bool:
    return seq_id.startswith(FETCH_SEQ_PREFIX)


def check_id(kind: str, value: object) -> str:
    """``value`` if it is a valid id, else ``InvalidArgument`` naming ``kind``."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"{kind} must be a non-empty string of at most {MAX_ID_LEN} chars, got {value!r}")
    return value


def seq_id_of(request_id: str) -> str:
    """A fresh sequence id for ``request_id`` (at most ``MAX_REQUEST_ID_LEN`` characters)."""
    if not 0 < len(request_id) <= MAX_REQUEST_ID_LEN:
        raise ValueError(f"request id of {len(request_id)} characters: must be 1..{MAX_REQUEST_ID_LEN}")
    return f"{request_id}-{secrets.token_hex(SEQ_SUFFIX_HEX // 2)}"


def attempt_id(seq_id: str, attempt: int) -> str:
    """The id a node serves attempt ``attempt`` (0 = the first) of ``seq_id`` under."""
    if not 0 <= attempt < MAX_ATTEMPTS:
        raise ValueError(f"attempt {attempt} of {seq_id!r}: at most {MAX_ATTEMPTS} attempts fit the id budget")
    return f"{seq_id}.{attempt}" if attempt else seq_id
