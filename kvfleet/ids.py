"""Ids, one rule for all: every id block_service stores (node, tenant, sequence) is a non-empty
string of at most ``MAX_ID_LEN`` characters.

A sequence id is the client's request id plus a suffix the router adds per attempt, so a request
resumed on another node never collides with its first attempt::

    request_id (at most MAX_REQUEST_ID_LEN) + "-" + 8 hex digits  →  seq_id (at most MAX_ID_LEN)
"""

from __future__ import annotations

from kvfleet.errors import InvalidArgument

MAX_ID_LEN = 128
SEQ_SUFFIX_HEX = 8
MAX_REQUEST_ID_LEN = MAX_ID_LEN - 1 - SEQ_SUFFIX_HEX


def check_id(kind: str, value: object) -> str:
    """``value`` if it is a valid id, else ``InvalidArgument`` naming ``kind``."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LEN:
        raise InvalidArgument(f"{kind} must be a non-empty string of at most {MAX_ID_LEN} chars, got {value!r}")
    return value
