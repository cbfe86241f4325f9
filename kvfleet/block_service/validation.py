"""The page table's checks of fields that every call shares: token counts and block hashes.

Each raises ``InvalidArgument`` with a message a person can act on, before anything changes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvfleet.core.block_hash import HASH_BYTES
from kvfleet.core.errors import InvalidArgument

MAX_TOKENS = (1 << 31) - 1      # more is an absurd count, not a refusal


def validate_tokens(n: object) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_TOKENS:
        raise InvalidArgument(f"num_tokens must be an integer in 0..{MAX_TOKENS}, got {n!r}")
    return n


def validate_hashes(hashes: Sequence[bytes]) -> None:
    for h in hashes:
        if not isinstance(h, bytes) or len(h) != HASH_BYTES:
            raise InvalidArgument(f"a block hash must be {HASH_BYTES} bytes, got {h!r:.60}")
    if len(set(hashes)) != len(hashes):
        raise InvalidArgument("block hashes repeat: a chained hash names one block of a prompt")
