"""Which of a peer's asked-for blocks this node may serve: the longest leading run of the hashes it
holds, in any tier, for the asking tenant. Pure Python.

    hashes  h0 h1 h2 h3 h4            (a prefix chain, parents first)
    held    P  H  D  .  P             (P pool, H host, D disk, . not held)
    run     h0 h1 h2                  the run ends at the first hash not held ...
    fence   h0 h1 [t'] ...            ... or held for another tenant (``fenced_at``: logged)

A hash names content under a salted chain (``kvfleet.core.block_hash``: the tenant's name, or its prefix
group's), and the holder serves it only under that salt: the block's recorded tenant must be the
asking one, or one whose chains take the same salt (a mate in the asker's prefix group; the holder's
``same_salt``). A block whose tenant is unknown (restored from a snapshot, which does not record it)
is not served either, as if not held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvfleet.compute_service.kv.block_usage import CommittedBlock
from kvfleet.compute_service.kv.tier_index import POOL, TierHeld


@dataclass(slots=True, frozen=True)
class HeldBlock:
    """One block to serve: where it is (a pool block id, or a host or disk slot) and its name."""

    tier: str                   # POOL, TIER_HOST, TIER_DISK
    slot: int
    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    extra: bytes
    hits: int = 0               # not carried over: the receiver counts its own


@dataclass(slots=True)
class HeldRun:
    blocks: list[HeldBlock]
    fenced_at: int | None = None  # the index of the first hash held under another salt, if that ended the run

    def slots_in(self, tier: str) -> tuple[list[int], list[int]]:
        """(positions in the run, slots) of the run's blocks held in ``tier``."""
        found = [(i, b.slot) for i, b in enumerate(self.blocks) if b.tier == tier]
        return [i for i, _ in found], [s for _, s in found]


def leading_run(hashes: Sequence[bytes], tenant: str, in_pool: Callable[[bytes], CommittedBlock | None],
                in_tiers: Callable[[bytes], TierHeld | None], max_blocks: int,
                same_salt: Callable[[str], bool] | None = None) -> HeldRun:
    """The run of ``hashes`` to serve to ``tenant``, at most ``max_blocks`` long; ``same_salt(owner)``:
    whether the blocks ``owner`` committed are salted as the asker's chain (default: ``owner`` is ``tenant``)."""
    serves = same_salt or tenant.__eq__
    run = HeldRun([])
    for i, block_hash in enumerate(hashes[:max_blocks]):
        pool = in_pool(block_hash)
        if pool is not None:
            owner, held = pool.tenant, HeldBlock(POOL, pool.block_id, block_hash, pool.parent_hash, pool.token_ids,
                                                 pool.extra)
        else:
            lower = in_tiers(block_hash)
            if lower is None or lower.name is None:
                break
            name = lower.name
            owner, held = lower.tenant, HeldBlock(lower.tier, lower.slot, block_hash, name.parent_hash, name.token_ids,
                                                  name.extra)
        if not owner or not serves(owner):
            run.fenced_at = i if owner else None
            break
        run.blocks.append(held)
    return run
