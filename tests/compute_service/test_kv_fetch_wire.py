"""The pure parts of a KV fetch: which blocks a holder serves (kv/held_run.py) and the run on the wire
(node/block_chunks.py: chunks of whole blocks, the receiver's checks), over synthetic rows."""

from __future__ import annotations

import pytest
import torch

from kvfleet.compute_service.kv.block_rows import BlockRows, RowLayout, empty_rows
from kvfleet.compute_service.kv.block_usage import BlockUsage, CommittedBlock
from kvfleet.compute_service.kv.held_run import HeldBlock, leading_run
from kvfleet.compute_service.kv.tier_index import POOL, TierHeld
from kvfleet.compute_service.node.block_chunks import RunReader, TransferRefused, encode, split_hashes
from kvfleet.core.allocator import TIER_DISK, TIER_HOST
from kvfleet.core.block_hash import block_hashes

SEED = b"wire-seed"
LAYOUT = RowLayout("fp8_e4m3", 16, 2, 2, 8)
TOKENS = list(range(100, 100 + 5 * 16))
CHAIN = block_hashes(TOKENS, 16, b"t", SEED)


def named(tier: str, i: int, tenant: str = "t"):
    block = CommittedBlock(i, CHAIN[i], CHAIN[i - 1] if i else b"", tuple(TOKENS[i * 16:(i + 1) * 16]),
                           b"t" if i == 0 else b"", tenant=tenant)
    return block if tier == POOL else TierHeld(tier, 40 + i, tenant, block)


def run_of(places: dict[int, tuple[str, str]], max_blocks: int = 99):
    """``places``: block index -> (tier, its tenant)."""
    held = {CHAIN[i]: named(tier, i, tenant) for i, (tier, tenant) in places.items()}

    def in_pool(h):
        b = held.get(h)
        return b if isinstance(b, CommittedBlock) else None

    def in_tiers(h):
        b = held.get(h)
        return b if isinstance(b, TierHeld) else None

    return leading_run(CHAIN, "t", in_pool, in_tiers, max_blocks)


def test_the_run_crosses_tiers_and_ends_at_the_first_block_not_held():
    run = run_of({0: (POOL, "t"), 1: (TIER_HOST, "t"), 2: (TIER_DISK, "t"), 4: (POOL, "t")})
    assert [(b.tier, b.slot) for b in run.blocks] == [(POOL, 0), (TIER_HOST, 41), (TIER_DISK, 42)]
    assert run.fenced_at is None
    assert run.slots_in(TIER_HOST) == ([1], [41])
    assert [b.token_ids for b in run.blocks] == [tuple(TOKENS[i * 16:(i + 1) * 16]) for i in range(3)]
    assert len(run_of({i: (POOL, "t") for i in range(5)}, max_blocks=2).blocks) == 2


def test_another_tenants_block_fences_the_run_and_an_unknown_tenant_only_ends_it():
    fenced = run_of({0: (POOL, "t"), 1: (TIER_HOST, "other"), 2: (POOL, "t")})
    assert len(fenced.blocks) == 1 and fenced.fenced_at == 1
    restored = run_of({0: (POOL, "")})  # a snapshot's block: no tenant recorded
    assert restored.blocks == [] and restored.fenced_at is None


def rows(n: int, seed: int = 0) -> BlockRows:
    g = torch.Generator().manual_seed(seed)
    out = empty_rows(LAYOUT, n)
    out.kv.copy_(torch.randn(out.kv.shape, generator=g).to(out.kv.dtype))
    out.scales.copy_(torch.rand(out.scales.shape, generator=g))
    return out


def blocks(n: int) -> list[HeldBlock]:
    return [HeldBlock(POOL, i, CHAIN[i], CHAIN[i - 1] if i else b"", tuple(TOKENS[i * 16:(i + 1) * 16]),
                      b"t" if i == 0 else b"") for i in range(n)]


def chunks(n: int, max_chunk_bytes: int, start: int = 0):
    sent = rows(n)
    return sent, list(encode(LAYOUT, blocks(5)[start:start + n], sent, sent.checksums(), max_chunk_bytes))


def test_a_run_in_chunks_of_whole_blocks_comes_back_identical_with_its_scales():
    row = LAYOUT.kv_bytes + LAYOUT.scale_bytes
    sent, out = chunks(5, 2 * row + 1)
    assert [len(c.checksums) for c in out] == [2, 2, 1]
    assert all(len(c.kv) + len(c.scales) <= 2 * row + 1 for c in out)
    assert [c.HasField("header") for c in out] == [True, False, False]
    reader = RunReader(LAYOUT, SEED, CHAIN, 0)
    for c in out:
        reader.feed(c)
    reader.finish()
    got = reader.rows()
    assert torch.equal(got.kv.view(torch.uint8), sent.kv.view(torch.uint8)) and torch.equal(got.scales, sent.scales)
    assert [b.block_hash for b in reader.blocks] == CHAIN and reader.blocks[0].extra == b"t"


def test_a_receiver_holding_the_first_blocks_reads_a_run_that_starts_past_them():
    _, out = chunks(3, 1 << 20, start=2)
    reader = RunReader(LAYOUT, SEED, CHAIN, 2)
    reader.feed(out[0])
    reader.finish()
    assert reader.verified == 3 and reader.blocks[0].parent_hash == CHAIN[1]


def test_no_block_held_is_one_chunk_of_a_header_naming_none():
    [only] = encode(LAYOUT, [], empty_rows(LAYOUT, 0), [], 1 << 20)
    reader = RunReader(LAYOUT, SEED, CHAIN, 0)
    reader.feed(only)
    reader.finish()
    assert reader.verified == 0 and len(reader.rows()) == 0


@pytest.mark.parametrize("spoil, why", [
    (lambda out: out[1].header.CopyFrom(out[0].header), "a chunk after the first carries a header"),
    (lambda out: out.insert(1, out.pop(2)), "does not carry the blocks asked for, in order"),
    (lambda out: out[0].header.blocks[1].token_ids.__setitem__(0, 7), "its header's block 1 is not the block asked for"),
    (lambda out: out[0].header.blocks.add(), "its header names 6 blocks, 5 were asked for"),
    (lambda out: setattr(out[1], "scales", out[1].scales[:-1]), "is not 2 whole blocks"),
])
def test_a_stream_that_breaks_the_rules_is_refused_keeping_the_blocks_before(spoil, why):
    _, out = chunks(5, 2 * (LAYOUT.kv_bytes + LAYOUT.scale_bytes))
    spoil(out)
    reader = RunReader(LAYOUT, SEED, CHAIN, 0)
    with pytest.raises(TransferRefused, match=why):
        for c in out:
            reader.feed(c)
        reader.finish()
    assert reader.verified in (0, 2)


def test_hashes_split_into_whole_16_byte_hashes():
    assert split_hashes(b"".join(CHAIN)) == CHAIN
    with pytest.raises(ValueError, match="not a whole number of 16-byte hashes"):
        split_hashes(b"\0" * 17)


def test_the_pool_block_holding_a_hash_is_found_until_it_is_handed_fresh():
    usage = BlockUsage()
    usage.committed(3, CHAIN[0], b"", TOKENS[:16], b"t", tenant="t")
    assert usage.find(CHAIN[0]).block_id == 3 and usage.find(CHAIN[0]).tenant == "t"
    usage.committed(5, CHAIN[0], b"", TOKENS[:16], b"t", tenant="t")  # computed again elsewhere
    usage.overwritten([3])
    assert usage.find(CHAIN[0]).block_id == 5
    usage.overwritten([5])
    assert usage.find(CHAIN[0]) is None and usage.find(CHAIN[1]) is None
