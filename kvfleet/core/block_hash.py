"""Chained block hashes: the names of full KV blocks, identical on every service.

    h_0 = H(seed; b"",  tokens[0:bs],   extra)      extra = tenant, or its prefix group (tenant_extra_key)
    h_i = H(seed; h_{i-1}, tokens[i*bs:(i+1)*bs])

H is keyed BLAKE2b with a 128-bit digest; the key is the cluster-wide seed, so a hash names the
same content on the router, every compute node and block_service. Only full blocks get a hash.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections.abc import Sequence

HASH_BYTES = 16
DEFAULT_SEED = b"kvfleet-block-hash-v1"


def cluster_seed() -> bytes:
    """The seed shared by the cluster (``KVFLEET_HASH_SEED``), else the built-in default."""
    value = os.environ.get("KVFLEET_HASH_SEED")
    return value.encode() if value else DEFAULT_SEED


def next_block_hash(parent: bytes, block_tokens: Sequence[int], extra: bytes = b"",
                    seed: bytes | None = None) -> bytes:
    """The hash of one full block given its parent's hash (``b""`` for the first block)."""
    h = hashlib.blake2b(digest_size=HASH_BYTES, key=(seed if seed is not None else cluster_seed())[:64])
    h.update(parent)
    h.update(array("I", block_tokens).tobytes())
    if not parent and extra:
        h.update(b"\x00extra\x00" + extra)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    seed: bytes | None = None,
    max_blocks: int | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (at most ``max_blocks`` of them)."""
    seed = seed if seed is not None else cluster_seed()
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    hashes: list[bytes] = []
    parent = b""
    for i in range(num_full):
        parent = next_block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], extra, seed)
        hashes.append(parent)
    return hashes


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a ``num_tokens``-long sequence may come from the prefix cache.

    The last token is always computed (its logits give the next token), so a prompt that fills
    its blocks exactly recomputes its last block:

        bs=4, n=8:  [t0 t1 t2 t3][t4 t5 t6 t7]   reusable 1 (t7 must be computed)
        bs=4, n=9:  [t0 t1 t2 t3][t4 t5 t6 t7][t8]   reusable 2

    Every allocator that names a sequence's reusable prefix (the engine's and the node's early
    allocation) asks with this many hashes, so an early allocation matches the engine's ask.
    """
    if num_tokens < 1 or block_size < 1:
        raise ValueError(f"num_tokens and block_size must be positive, got {num_tokens} and {block_size}")
    return (num_tokens - 1) // block_size


GROUP_MARK = b"\x00group\x00"  # no tenant name holds a NUL (kvfleet.core.ids.check_id): a group never salts as a tenant


def tenant_extra_key(tenant: str, share_across_tenants: bool = False, prefix_group: str = "") -> bytes:
    """The extra key (salt) of a sequence's first block: its tenant; its prefix group when it has one
    (the group's tenants share cached prefixes, ``kvfleet.core.tenants``); nothing when the whole cluster
    shares prefixes by config. The router decides the group from the tenant's credentials."""
    if share_across_tenants:
        return b""
    return GROUP_MARK + prefix_group.encode() if prefix_group else tenant.encode()
