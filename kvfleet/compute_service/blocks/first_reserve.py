"""A sequence's first allocation carries its reserve block: what it asks block_service for, and
what it asks again when the reserve alone made it not fit. Pure (``allocator_policy.py`` uses it).

The first allocation asks through one block past the prompt (``ask_tokens``), so a prompt that
fills its blocks exactly has the block of its first decoded token at once. None past
``max_model_len`` (a contiguous reservation is that long already), none for a chain whose every
token is in a named block (an import: it never grows). Refused for room with the reserve, by
figures that say the reserve alone made the difference, the blocks alone are asked again
(``without_reserve``): a reserve never costs an admission, and a top-up brings it later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvfleet.core.allocator import AllocateRequest, Allocation, Refusal


class FirstReserve:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.max_tokens: int | None = None   # no sequence grows past this (max_model_len)
        self._plain: dict[str, int] = {}     # early asks sent with a reserve → the tokens without it

    def ask_tokens(self, block_hashes: Sequence[bytes], num_tokens: int) -> int:
        """What a first allocation of ``num_tokens`` asks block_service for: through the reserve
        block (the blocks the tokens need, plus one), unless that passes ``max_tokens`` or every
        token is in a named block."""
        need = self._blocks(num_tokens)
        if len(block_hashes) * self.block_size >= num_tokens:
            return num_tokens
        if self.max_tokens is not None and need * self.block_size >= self.max_tokens:
            return num_tokens
        return (need + 1) * self.block_size

    def without_reserve(self, num_tokens: int, asked: int, refusal: Refusal) -> int | None:
        """What to ask next for a first allocation of ``num_tokens`` that block_service refused
        when asked for ``asked``: the tokens alone, when the refusal was for room (the pool or the
        tenant's quota) and by its figures the reserve alone may have made the difference. None:
        the refusal stands, and a sequence waiting for a full pool costs one call a step, as it
        did before the reserve."""
        reserve = self._blocks(asked) - self._blocks(num_tokens)
        if reserve <= 0 or refusal.reason not in ("pool", "quota"):
            return None
        # the room it reports is at most what the ask may take (pinned cache, others' reservations)
        shortfall = refusal.blocks_asked - (refusal.blocks_allowed - refusal.blocks_charged)
        return num_tokens if shortfall <= reserve else None

    def with_reserve(self, requests: Sequence[AllocateRequest]) -> list[AllocateRequest]:
        """Early asks about to be sent, each through its reserve block (remembered until answered)."""
        sent: list[AllocateRequest] = []
        for request in requests:
            tokens = self.ask_tokens(request.block_hashes, request.num_tokens)
            if tokens != request.num_tokens:
                self._plain[request.seq_id] = request.num_tokens
                request = replace(request, num_tokens=tokens)
            sent.append(request)
        return sent

    def asks_again(self, asks: Sequence[AllocateRequest],
                   results: Sequence[Allocation | Refusal | None]) -> list[tuple[int, AllocateRequest]]:
        """Of sent early asks, those to send again at once without their reserve, each with its
        index in ``asks``."""
        again: list[tuple[int, AllocateRequest]] = []
        for i, (request, result) in enumerate(zip(asks, results)):
            plain = self._plain.get(request.seq_id, request.num_tokens)
            if isinstance(result, Refusal) and self.without_reserve(plain, request.num_tokens, result) is not None:
                again.append((i, replace(request, num_tokens=plain)))
        return again

    def answered(self, asks: Sequence[AllocateRequest]) -> None:
        for request in asks:
            self._plain.pop(request.seq_id, None)

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
