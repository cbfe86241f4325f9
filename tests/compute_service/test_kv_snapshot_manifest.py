"""The pure parts of a KV snapshot: which blocks go in, the fingerprint, the manifest's checks."""

from __future__ import annotations

import dataclasses

import pytest

import kvfleet.compute_service.kv.snapshot as ks
from kvfleet.compute_service.kv.block_usage import BlockUsage
from kvfleet.core.block_hash import next_block_hash

SEED = b"test-seed"
BS = 4
FP = ks.Fingerprint("m0", "float32", "float32", BS, 2, 2, 8, "s0")


def chain(usage: BlockUsage, first_id: int, tokens: list[int], extra: bytes = b"t") -> list[bytes]:
    """Commit the full blocks of ``tokens`` at ids first_id, first_id + 1, ...; their hashes."""
    hashes, parent = [], b""
    for i in range(len(tokens) // BS):
        block = tokens[i * BS:(i + 1) * BS]
        h = next_block_hash(parent, block, extra, SEED)
        usage.committed(first_id + i, h, parent, block, extra)
        hashes.append(h)
        parent = h
    return hashes


def test_most_reused_first_parents_before_children_and_limit_keeps_chains_whole():
    usage = BlockUsage()
    a, b, c = chain(usage, 0, list(range(12)))          # a ─ b ─ c
    e, d = chain(usage, 10, [9] * 8)                    # e ─ d
    usage.hit([0, 1], [a, b])
    usage.hit([0, 1], [a, b])
    usage.hit([0, 1, 2], [a, b, c])
    usage.hit([11], [d])                                 # d hit without its parent (as a test can)
    usage.hit([11], [d])
    ranked = [blk.block_hash for blk in ks.rank_blocks(usage.blocks(), 3)]
    # d (2 hits) needs e first: 4 blocks do not fit in 3, so c comes instead
    assert ranked == [a, b, c]
    everything = [blk.block_hash for blk in ks.rank_blocks(usage.blocks(), 10)]
    assert everything.index(e) < everything.index(d) and everything.index(a) < everything.index(b) < everything.index(c)


def test_a_block_whose_parent_was_overwritten_is_left_out():
    usage = BlockUsage()
    a, b = chain(usage, 0, list(range(8)))
    usage.overwritten([0])
    assert ks.rank_blocks(usage.blocks(), 10) == []
    assert len(usage) == 1


def test_a_hit_on_a_block_under_another_name_changes_nothing():
    usage = BlockUsage()
    (a,) = chain(usage, 0, list(range(4)))
    version = usage.version
    usage.hit([0], [b"x" * 16])
    assert usage.blocks()[0].hits == 0 and usage.version == version


def test_fingerprint_names_the_first_difference():
    assert FP.mismatch(FP) is None
    other = dataclasses.replace(FP, block_size=32)
    assert other.mismatch(FP) == "block_size 32 here, 4 in the snapshot"
    assert dataclasses.replace(FP, model="m1").mismatch(FP) == "model m1 here, m0 in the snapshot"


def manifest_json(usage: BlockUsage) -> str:
    return ks.Manifest(FP, "n0", ks.snapshot_blocks(ks.rank_blocks(usage.blocks(), 100))).to_json()


def test_manifest_round_trip_and_paths():
    usage = BlockUsage()
    chain(usage, 0, list(range(12)))
    chain(usage, 5, list(range(4)) + [7] * 4)           # shares the first block: a second leaf
    manifest = ks.Manifest.from_json(manifest_json(usage), FP, SEED)
    assert len(manifest.blocks) == 4
    paths = ks.restore_paths(manifest.blocks)
    assert sorted(len(p) for p in paths) == [2, 3]
    assert all(p[0] == paths[0][0] for p in paths)


@pytest.mark.parametrize("mangle, why", [
    (lambda text: text.replace('"block_size":4', '"block_size":8'), "block_size 4 here, 8 in the snapshot"),
    (lambda text: text[:-5], "malformed"),
    (lambda text: text.replace('"m0"', '0'), "fingerprint's model is malformed"),
])
def test_a_manifest_that_is_not_this_nodes_is_refused(mangle, why):
    usage = BlockUsage()
    chain(usage, 0, list(range(8)))
    with pytest.raises(ks.SnapshotRefused, match=why):
        ks.Manifest.from_json(mangle(manifest_json(usage)), FP, SEED)


def test_hashes_that_do_not_name_their_tokens_are_refused():
    usage = BlockUsage()
    chain(usage, 0, list(range(8)))
    with pytest.raises(ks.SnapshotRefused, match="another hash seed"):
        ks.Manifest.from_json(manifest_json(usage), FP, b"other-seed")
    text = manifest_json(usage).replace("[0,1,2,3]", "[0,1,2,9]")
    with pytest.raises(ks.SnapshotRefused, match="does not name its tokens"):
        ks.Manifest.from_json(text, FP, SEED)


def test_a_child_before_its_parent_is_refused():
    usage = BlockUsage()
    chain(usage, 0, list(range(8)))
    manifest = ks.Manifest.from_json(manifest_json(usage), FP, SEED)
    manifest.blocks.reverse()
    with pytest.raises(ks.SnapshotRefused, match="before its parent"):
        ks.Manifest.from_json(manifest.to_json(), FP, SEED)
