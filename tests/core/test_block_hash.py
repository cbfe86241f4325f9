"""Block hashes name a block by its whole prefix, its tenant and the cluster seed; the reusable rule
leaves the last token to compute."""

from __future__ import annotations

import pytest

from kvfleet.core.block_hash import (
    DEFAULT_SEED,
    HASH_BYTES,
    block_hashes,
    cluster_seed,
    next_block_hash,
    reusable_blocks,
    tenant_extra_key,
)

BS = 4


def test_hashes_chain_through_the_whole_prefix():
    ids = list(range(12))
    hs = block_hashes(ids, BS)
    assert len(hs) == 3 and all(len(h) == HASH_BYTES for h in hs) and len(set(hs)) == 3
    parent = b""
    for i, h in enumerate(hs):  # each block's hash is its parent's, folded with its own tokens
        parent = next_block_hash(parent, ids[i * BS:(i + 1) * BS])
        assert h == parent
    changed = block_hashes([99] + ids[1:], BS)  # one token of the first block differs: every name differs
    assert all(a != b for a, b in zip(hs, changed))
    later = block_hashes(ids[:4] + [99] + ids[5:], BS)  # the second block differs: the first keeps its name
    assert later[0] == hs[0] and later[1:] != hs[1:]


def test_only_full_blocks_are_named_and_max_blocks_caps_them():
    ids = list(range(10))
    assert block_hashes(ids, BS) == block_hashes(ids[:8], BS)  # the 2 tokens of a partial block: no name
    assert block_hashes(ids, BS, max_blocks=1) == block_hashes(ids, BS)[:1]
    assert block_hashes(ids, BS, max_blocks=0) == []
    assert block_hashes(ids, BS, max_blocks=5) == block_hashes(ids, BS)
    assert block_hashes(ids[:3], BS) == []


def test_the_tenant_key_separates_tenants_unless_prefixes_are_shared():
    ids = list(range(8))
    a = block_hashes(ids, BS, tenant_extra_key("a"))
    b = block_hashes(ids, BS, tenant_extra_key("b"))
    assert all(x != y for x, y in zip(a, b))  # the extra key of the first block reaches every block
    assert tenant_extra_key("a", share_across_tenants=True) == tenant_extra_key("b", share_across_tenants=True) == b""
    assert block_hashes(ids, BS, tenant_extra_key("a", True)) == block_hashes(ids, BS)
    # the extra key goes into the first block only: a child's name depends on it through its parent
    assert next_block_hash(a[0], ids[4:8], b"a") == next_block_hash(a[0], ids[4:8]) == a[1]


def test_the_seed_keys_every_name(monkeypatch):
    ids = list(range(8))
    assert block_hashes(ids, BS, seed=b"other") != block_hashes(ids, BS)
    monkeypatch.delenv("KVFLEET_HASH_SEED", raising=False)
    assert cluster_seed() == DEFAULT_SEED
    default = block_hashes(ids, BS)
    monkeypatch.setenv("KVFLEET_HASH_SEED", "other")
    assert cluster_seed() == b"other" and block_hashes(ids, BS) == block_hashes(ids, BS, seed=b"other") != default


@pytest.mark.parametrize(("num_tokens", "reusable"), [
    (1, 0),            # a lone token is computed
    (BS, 0),           # one full block: its last token is computed, so the block is too
    (BS + 1, 1),       # the first block is whole and the last token is in the next
    (2 * BS, 1),       # two full blocks: the second holds the token to compute
    (2 * BS + 1, 2),
])
def test_reusable_blocks_leave_the_last_token_to_compute(num_tokens, reusable):
    assert reusable_blocks(num_tokens, BS) == reusable


@pytest.mark.parametrize(("num_tokens", "block_size"), [(0, BS), (-1, BS), (4, 0)])
def test_reusable_blocks_refuses_an_empty_sequence_or_block(num_tokens, block_size):
    with pytest.raises(ValueError, match="must be positive"):
        reusable_blocks(num_tokens, block_size)
