"""The lazy LRU against the ``OrderedDict`` it stands for, and the binary snapshot format:
round trips, the pool arrays' encodings, corrupt or foreign files refused with one line."""

from __future__ import annotations

import json
import random
import struct
import zlib
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfleet.block_service.durable import DurablePageTable
from kvfleet.block_service.eviction.lru import SLACK, BlockLru
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.pool_codec import runs_stack, stack_runs
from kvfleet.block_service.recovery import recover
from kvfleet.block_service.snapshot import (
    MAGIC_V1,
    SnapshotError,
    decode_snapshot,
    encode_snapshot,
    read_snapshot,
)
from kvfleet.core.allocator import AllocateRequest
from tests.examples import examples

N = 40


class Model:
    """The old cache: an ``OrderedDict`` of block → None, least recently used first."""

    def __init__(self) -> None:
        self.d: OrderedDict[int, None] = OrderedDict()

    def extend(self, blocks: list[int]) -> None:
        for b in blocks:
            self.d[b] = None

    def remove_many(self, blocks: list[int]) -> None:
        for b in blocks:
            del self.d[b]

    def pop_oldest(self) -> int:
        return self.d.popitem(last=False)[0]


def _drive(lru: BlockLru, model: Model, rng: random.Random, steps: int) -> None:
    for _ in range(steps):
        cached = list(model.d)
        outside = [b for b in range(N) if b not in model.d]
        op = rng.randrange(5)
        pool = outside if op < 2 else cached  # 0, 1: make blocks cached; 2, 3: revive cached ones
        if op < 4 and pool:
            blocks = rng.sample(pool, rng.randint(1, min(8, len(pool))) if op % 2 == 0 else 1)
            if op < 2:
                lru.extend(blocks) if op == 0 else lru.append(blocks[0])
                model.extend(blocks)
            else:
                lru.remove_many(blocks) if op == 2 else lru.remove(blocks[0])
                model.remove_many(blocks)
        elif cached:
            assert lru.pop_oldest() == model.pop_oldest()
        assert list(lru) == list(model.d) and len(lru) == len(model.d)
        assert all((b in lru) == (b in model.d) for b in range(N))
        assert len(lru.queue) <= 2 * len(lru) + SLACK + 1, "stale entries are never compacted away"


@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 400))
def test_lazy_lru_keeps_the_ordered_dicts_order(seed: int, steps: int) -> None:
    """Appends, revivals from the middle, evictions: the same order, pops and membership as the
    ``OrderedDict``, through any number of compactions."""
    _drive(BlockLru(N), Model(), random.Random(seed), steps)


def test_lru_restored_mid_history_carries_on_alike() -> None:
    rng = random.Random(5)
    lru, model = BlockLru(N), Model()
    _drive(lru, model, rng, 300)
    restored = BlockLru.from_order(N, lru.order())
    assert len(restored.queue) == len(restored) == len(model.d)  # no stale entries in a snapshot
    _drive(restored, model, rng, 300)


def test_eviction_takes_the_deepest_block_of_the_least_recently_released_sequence() -> None:
    table = PageTable("lru")
    table.register_node("n", 8, 16, 1 << 18)
    hashes = {s: [bytes([s, i]) * 8 for i in range(3)] for s in (1, 2)}
    for s in (1, 2):
        table.allocate_many([AllocateRequest("n", f"s{s}", "t", hashes[s], 48)])
        table.commit([(f"s{s}", i, hashes[s][i]) for i in range(3)])
    table.release(["s1", "s2"])  # s1 released first: its blocks are the least recently used
    table.allocate_many([AllocateRequest("n", "hit", "t", hashes[1][:1], 16)])  # revives s1's first block
    table.release(["hit"])
    fresh = table.allocate_many([AllocateRequest("n", "x", "t", [], 5 * 16)])[0].block_ids
    assert fresh[:2] == [6, 7]  # the free blocks first
    assert fresh[2:] == [2, 1, 5], "deepest block of the least recently released sequence first"


@pytest.mark.parametrize("stack", [[], [7], [9, 8, 7, 3, 2, 11, 0], list(range(99, -1, -1)), [4, 6, 8]])
def test_free_stack_runs_round_trip(stack: list[int]) -> None:
    a = np.array(stack, dtype=np.uint32)
    runs = stack_runs(a)
    assert runs_stack(runs).tolist() == stack
    if stack == list(range(99, -1, -1)):
        assert runs.tolist() == [99, 100]  # one run: a pool nobody took from yet


def _table() -> PageTable:
    table = PageTable("lru")
    table.register_node("a", 300, 16, 1 << 18)
    table.register_node("b", 50, 32, 1 << 18)
    rng = random.Random(3)
    for k in range(40):
        node = "a" if k % 3 else "b"
        n = rng.randint(1, 6)
        hashes = [bytes([k % 7, i]) * 8 for i in range(n)]
        table.allocate_many([AllocateRequest(node, f"s{k}", "xy"[k % 2], hashes, n * 16 * (1 if node == "a" else 2))])
        table.commit([(f"s{k}", i, hashes[i]) for i in range(n)])
        if k % 4:
            table.release([f"s{k}"])
    return table


def test_binary_snapshot_round_trip_is_exact() -> None:
    table = _table()
    data = encode_snapshot(42, table.to_dict())
    assert data.startswith(b"KVFSNAP2")
    lsn, state = decode_snapshot(data)
    restored = PageTable.from_dict(state)
    restored.check()
    assert lsn == 42 and restored.to_dict() == table.to_dict()
    # the restored table then behaves exactly the same (same block ids, same evictions)
    for t in (table, restored):
        t.allocate_many([AllocateRequest("a", "new", "x", [], 280 * 16)])
    assert restored.to_dict() == table.to_dict()


def test_a_snapshot_of_format_1_still_loads(tmp_path) -> None:
    """A state directory written before format 2 (JSON, pools as base64 strings) recovers (without
    the cached blocks' last owners, which that form did not keep)."""
    import base64

    table = _table()
    expected, state = table.to_dict(), table.to_dict()
    for nd in expected["nodes"].values():
        del nd["pool"]["cached_owner"]
    for nd in state["nodes"].values():  # the pools as format 1 held them: "v": 2, zlib + base64
        p = nd["pool"]
        del p["cached_owner"]
        z = lambda raw: base64.b64encode(zlib.compress(bytes(raw))).decode()  # noqa: E731
        b64 = lambda raw: base64.b64encode(bytes(raw)).decode()  # noqa: E731
        hashed = np.flatnonzero(np.unpackbits(np.frombuffer(p["hashed"], np.uint8), count=p["shape"][0],
                                              bitorder="little")).astype("<u4")
        free = runs_stack(np.frombuffer(p.pop("free_runs"), "<u4")) if "free_runs" in p else np.frombuffer(p["free"], "<u4")
        p.update(v=2, used=b64(p["used"]), ref=b64(p["ref"]), owner=b64(p["owner"]), free=z(free.tobytes()),
                 lru=z(p["lru"]), hashed=z(hashed.tobytes()), hashes=b64(p["hashes"]),
                 unindexed=np.frombuffer(p["unindexed"], "<u4").tolist())
    payload = json.dumps(state).encode()
    body = struct.pack("<8sQQ", MAGIC_V1, 9, len(payload)) + payload
    (tmp_path / f"snapshot-{9:020d}.snap").write_bytes(body + struct.pack("<I", zlib.crc32(body)))
    recovered, report = recover(str(tmp_path))
    assert report.snapshot_lsn == 9 and recovered.to_dict() == expected


def _written(tmp_path) -> tuple[str, dict]:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("a", 64, 16, 1 << 18)
    store.allocate_many([AllocateRequest("a", "s", "t", [b"\x01" * 16, b"\x02" * 16], 32)])
    store.commit([("s", 0, b"\x01" * 16), ("s", 1, b"\x02" * 16)])
    store.release(["s"])
    path = store.snapshot()
    expected = store.table.to_dict()
    store.close()
    return path, expected


def test_every_flipped_byte_of_a_snapshot_is_refused(tmp_path) -> None:
    path, expected = _written(tmp_path)
    data = open(path, "rb").read()
    assert read_snapshot(path)[1] is not None and PageTable.from_dict(read_snapshot(path)[1]).to_dict() == expected
    for at in range(8, len(data), max(1, len(data) // 97)):  # header, JSON, blob lengths, blobs, CRC
        bad = bytearray(data)
        bad[at] ^= 0x10
        with pytest.raises(SnapshotError):
            decode_snapshot(bytes(bad), "snap")


@pytest.mark.parametrize("cut", [1, 4, 13, 100])
def test_a_truncated_snapshot_is_refused(tmp_path, cut: int) -> None:
    path, _ = _written(tmp_path)
    data = open(path, "rb").read()
    with pytest.raises(SnapshotError, match="^snap: "):
        decode_snapshot(data[:-cut], "snap")


def test_a_snapshot_of_an_unknown_format_is_refused_with_one_line(tmp_path) -> None:
    path, _ = _written(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[7:8] = b"9"
    with pytest.raises(SnapshotError) as err:
        decode_snapshot(bytes(data), "snap")
    assert "format '9' is not one this version reads" in str(err.value) and "\n" not in str(err.value)


def test_a_corrupt_newest_snapshot_falls_back_to_the_older_one_and_its_log(tmp_path) -> None:
    store, _ = DurablePageTable.open(str(tmp_path), fsync=False)
    store.register_node("a", 64, 16, 1 << 18)
    store.snapshot()
    store.allocate_many([AllocateRequest("a", "s", "t", [b"\x03" * 16], 16)])
    store.commit([("s", 0, b"\x03" * 16)])
    store.sync()
    newest = store.snapshot()
    expected = store.table.to_dict()
    store.sync()
    data = bytearray(open(newest, "rb").read())
    data[len(data) // 2] ^= 1
    open(newest, "wb").write(bytes(data))
    recovered, report = recover(str(tmp_path))
    assert recovered.to_dict() == expected and report.snapshot_path != newest


def _node_with(table: PageTable, node: str, seq: str, hashes: list[bytes], look_up: bool = True) -> None:
    """A sequence of ``hashes`` committed and released (``look_up``: allocated with its hashes, else
    with none, so that the commit is the first call to meet them)."""
    table.allocate_many([AllocateRequest(node, seq, "t", hashes if look_up else [], 16 * len(hashes))])
    table.commit([(seq, i, h) for i, h in enumerate(hashes)])
    table.release([seq])


def _recovered(table: PageTable) -> PageTable:
    return PageTable.from_dict(decode_snapshot(encode_snapshot(1, table.to_dict()))[1])


def test_recovered_index_answers_like_the_one_it_was_saved_from() -> None:
    """After a recovery the single-holder hashes sit in ``FrozenKeys``: every question, and every
    change that moves them back into the dict, gives what the table before the snapshot gives."""
    before = PageTable("lru")
    for node in "abc":
        before.register_node(node, 64, 16, 1 << 18)
    shared = [bytes([9, i]) * 8 for i in range(4)]
    for k, node in enumerate("abc"):
        _node_with(before, node, f"p{k}", shared + [bytes([k, i]) * 8 for i in range(6)])
    after = _recovered(before)
    probes = [shared + [bytes([k, i]) * 8 for i in range(6)] for k in range(3)] + [[bytes([1, 0]) * 8]]
    for t in (before, after):  # first changes (nothing read yet): c takes a's private hashes, a evicts them
        _node_with(t, "c", "x", [bytes([0, i]) * 8 for i in range(6)], look_up=False)
        t.allocate_many([AllocateRequest("a", "big", "t", [], 60 * 16)])
    assert [after.match_prefix(p) for p in probes] == [before.match_prefix(p) for p in probes]
    before.check()
    after.check()  # (reads every hash: all of them are in the dict from here on)
    assert after.match_prefix(probes[0]) == {"a": 4, "b": 4, "c": 10}
    assert after.to_dict() == before.to_dict()
    after.deregister_node("c")
    after.check()


def test_hashes_alike_in_their_first_eight_bytes_stay_apart() -> None:
    """``FrozenKeys`` sorts by the first eight bytes; hashes that share them (with or without a
    shared holder) are indexed one by one, and a query alike in those bytes finds nothing."""
    table = PageTable("lru")
    for node in "abc":
        table.register_node(node, 16, 16, 1 << 18)
    x, y, z = b"\x07" * 8 + b"\x01" * 8, b"\x07" * 8 + b"\x02" * 8, b"\x08" * 8 + b"\x01" * 8
    _node_with(table, "a", "s1", [x, z])
    _node_with(table, "b", "s2", [y])
    _node_with(table, "c", "s3", [x])
    after = _recovered(table)
    near_z = b"\x08" * 8 + b"\x02" * 8  # z's first eight bytes
    assert after.match_prefix([near_z, near_z[:15] + b"\x03", z]) == {"a": 0, "b": 0, "c": 0}  # (one numpy pass)
    assert after.match_prefix([near_z]) == {"a": 0, "b": 0, "c": 0}
    assert after.match_prefix([x, z]) == {"a": 2, "b": 0, "c": 1}
    assert after.match_prefix([y]) == {"a": 0, "b": 1, "c": 0}
    assert after.match_prefix([b"\x07" * 8 + b"\x03" * 8]) == {"a": 0, "b": 0, "c": 0}
    after.check()


def test_prompts_read_first_after_a_recovery_match_as_before() -> None:
    """The first reads after a recovery move a prompt's keys out of ``FrozenKeys`` in one pass; a
    hash no node holds, or one already moved, must not shift the others."""
    table = PageTable("lru")
    for node in "ab":
        table.register_node(node, 32, 16, 1 << 18)
    p = [bytes([5, i]) * 8 for i in range(4)]
    _node_with(table, "a", "s1", p)
    _node_with(table, "b", "s2", p[:2])
    prompts = [[p[1], p[0], p[2]], [p[0], p[3], p[2]], [p[1], b"\x00" * 16, p[2], p[3]], [b"\x01" * 16, p[0]], p]
    expected = [table.match_prefix(q) for q in prompts]
    after = _recovered(table)
    assert [after.match_prefix(q) for q in prompts] == expected
    assert after.allocate_many([AllocateRequest("a", "x", "t", p, 64)])[0].num_cached_blocks == 4
    after.check()


def test_lower_tier_matches_read_recovered_keys_past_the_hot_run() -> None:
    """``match_tiers`` walks on past the first hash the pools miss (a lower tier may hold it): keys
    still in ``FrozenKeys`` beyond that point count as they did before the snapshot."""
    from kvfleet.core.allocator import TIER_HOST, TierChange

    table = PageTable("lru")
    table.register_node("a", 32, 16, 1 << 18)
    p = [bytes([6, i]) * 8 for i in range(5)]
    _node_with(table, "a", "s", [p[0], p[1], b"\x02" * 16, p[3], p[4]])  # p[2] not in the pool...
    table.record_tiers("a", [TierChange(p[2], "t", TIER_HOST)])        # ...but in host memory
    expected = table.match_tiers(p)
    assert expected == ({"a": 2}, {"a": 3})
    assert _recovered(table).match_tiers(p) == expected
