"""How much of a prompt each node already holds: block hashes → block_service's prefix index.

The prompt's full blocks are hashed exactly as the nodes hash them (``kvfleet.block_hash``, the
tenant as the first block's extra key), once per block size in use, and block_service answers per
node how many leading blocks are committed there.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.nodes import RouterNode


class NoPrefixLookup:
    """Without block_service every node looks cold: routing falls back to load alone."""

    async def match(self, tenant: str, token_ids: Sequence[int], nodes: Sequence[RouterNode]) -> dict[str, int]:
        return {}

    async def close(self) -> None:
        pass


async def connect_prefix_lookup(address: str | None):
    if not address:
        return NoPrefixLookup()
    raise NotImplementedError("prefix lookup through block_service: waiting for its client")
