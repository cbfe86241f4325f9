"""A pool in a snapshot: its arrays as raw little-endian bytes, which the snapshot file carries as
binary blobs beside its JSON (``snapshot``, format 2).

    {"shape": [num_blocks, block_size, bytes_per_block], "v": 3,
     "used": u32[] blocks with a reference, "ref": u32[] their counts,
     "owner": u16[] their tenants (1 + an index into "owners"), "owners": [tenant, ...],
     "cached_owner": u16[] the tenant last charged for each cached block (a hashed block without a
             reference), in ascending block order, for the evictions' labels (absent: none known),
     "free": u32[] the free stack  or  "free_runs": u32[first, length, ...] the same stack as runs
             first, first - 1, ..., first - length + 1 (whichever is smaller),
     the eviction policy's own fields (``EvictionPolicy.to_state``; the LRU's:
     "lru": i32[] cached blocks, least recently used first),
     "facts": {"hits": u32[] per block, "tick": n}  only for a policy that asks for facts,
     "hashed": a bitmap of the blocks holding a hash (bit b of byte b // 8, numpy's little order),
     "hashes": their hashes, concatenated in ascending block order,
     "unindexed": u32[] blocks whose hash the node indexes at another block}

Only what is not the default is written, and nothing is compressed: at 100,000 blocks 20% cached a
pool is ~0.45 MB, and it is encoded and decoded by numpy (``frombuffer``, fancy indexing), never a
Python statement per block — zlib alone took ~10 ms per pool, base64 and the JSON strings more
(snapshot and recovery of 1,000 such pools in under a minute). The free stack is nearly
always a few descending runs (blocks are handed out from its end), so it is usually a few bytes.

The policy's fields sit beside the pool's (not under a key of their own), so that a pool under the
LRU policy is written exactly as before policies could be chosen. Pools of the earlier forms still
load, all of them LRU: ``"v": 2`` (the same arrays, zlib and base64 in JSON strings) and the first
form (one JSON value per block and field).
"""

from __future__ import annotations

import base64
import zlib
from array import array

import numpy as np

from kvfleet.block_service.block_pool import BlockPool, PoolState
from kvfleet.block_service.eviction import DEFAULT_POLICY, policy_class
from kvfleet.block_service.prefix_index import PrefixIndex

U32, I32, U16 = np.dtype("<u4"), np.dtype("<i4"), np.dtype("<u2")
VERSION = 3


def _array(typecode: str, raw, dtype: np.dtype) -> array:
    """A native ``array`` of ``raw``'s little-endian values (a copy the pool may change)."""
    a = array(typecode)
    a.frombytes(np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=False).tobytes())
    return a


def _values(raw, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise ValueError(f"an array of {dtype.itemsize}-byte values has {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype)


def stack_runs(stack: np.ndarray) -> np.ndarray:
    """``[first, length, ...]`` of the descending runs ``first, first - 1, ...`` making ``stack``."""
    s = stack.astype(np.int64)
    starts = np.flatnonzero(np.diff(s) != -1) + 1 if len(s) > 1 else np.zeros(0, np.int64)
    starts = np.concatenate(([0], starts)) if len(s) else starts
    lengths = np.diff(np.append(starts, len(s)))
    return np.column_stack((s[starts], lengths)).ravel().astype(np.uint32)


def runs_stack(runs: np.ndarray) -> np.ndarray:
    """The inverse of ``stack_runs``: steps of -1 with each run's jump from the one before, summed."""
    r = runs.astype(np.int64).reshape(-1, 2)
    first, lengths = r[:, 0], r[:, 1]
    if len(r) == 0:
        return np.zeros(0, np.uint32)
    last = first - lengths + 1
    if lengths.min() < 1 or last.min() < 0:
        raise ValueError("a run of the free stack goes below block 0 or is empty")
    steps = np.full(int(lengths.sum()), -1, dtype=np.int64)
    steps[np.cumsum(lengths) - lengths] = first - np.concatenate(([0], last[:-1]))
    return np.cumsum(steps).astype(np.uint32)


def pool_to_dict(pool: BlockPool) -> dict:
    s = pool.state()
    n = s.shape[0]
    ref = np.frombuffer(array("I", s.ref), dtype=np.uint32) if isinstance(s.ref, list) else np.asarray(s.ref)
    used = np.flatnonzero(ref).astype(U32)
    owner = np.frombuffer(s.owner, dtype=np.uint16)
    bits = np.zeros(n, dtype=bool)
    bits[s.hashed] = True
    free = np.frombuffer(s.free, dtype=np.uint32) if len(s.free) else np.zeros(0, np.uint32)
    runs = stack_runs(free)
    d = {
        "shape": list(s.shape), "v": VERSION, "used": used.tobytes(), "ref": ref[used].astype(U32).tobytes(),
        "owner": owner[used].astype(U16).tobytes(), "owners": list(s.owners),
        "hashed": np.packbits(bits, bitorder="little").tobytes(),
        "hashes": s.hashes, "unindexed": np.asarray(s.unindexed, dtype=U32).tobytes(),
    }
    cached = s.hashed[ref[s.hashed] == 0]
    if len(cached) and owner[cached].any():
        d["cached_owner"] = owner[cached].astype(U16).tobytes()
    if len(runs) < len(free):
        d["free_runs"] = runs.astype(U32).tobytes()
    else:
        d["free"] = free.astype(U32).tobytes()
    assert not d.keys() & s.eviction.keys(), "an eviction policy's field shadows one of the pool's"
    d.update(s.eviction)
    if s.facts is not None:
        d["facts"] = s.facts
    return d


def pool_from_dict(d: dict, index: PrefixIndex | None = None, slot: int = 0,
                   eviction: str = DEFAULT_POLICY) -> BlockPool:
    v = d.get("v")
    if v == VERSION:
        keys = policy_class(eviction).state_keys
        missing = [k for k in keys if k not in d]
        if missing:
            raise ValueError(f"a pool's eviction state ({eviction}) lacks {', '.join(missing)}")
        state = _state_v3(d, {k: d[k] for k in keys})
    else:
        state = _state_v2(d) if v == 2 else _state_v1(d)
    return BlockPool.from_state(state, index, slot, eviction)


def _state_v3(d: dict, eviction: dict) -> PoolState:
    n = d["shape"][0]
    bits = np.frombuffer(d["hashed"], dtype=np.uint8)
    if len(bits) != (n + 7) // 8:
        raise ValueError(f"a pool's hash bitmap has {len(bits)} bytes for {n} blocks")
    hashed = np.flatnonzero(np.unpackbits(bits, count=n, bitorder="little")).astype(np.uint32)
    used = _values(d["used"], U32)
    ref, owner = np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.uint16)
    counts, owners = _values(d["ref"], U32), _values(d["owner"], U16)
    if not len(used) == len(counts) == len(owners) or (len(used) and int(used.max()) >= n):
        raise ValueError("a pool's used blocks, their counts and their owners do not fit together")
    ref[used], owner[used] = counts, owners
    if "cached_owner" in d:
        cached, last = hashed[ref[hashed] == 0], _values(d["cached_owner"], U16)
        if len(cached) != len(last) or (len(last) and int(last.max()) > len(d["owners"])):
            raise ValueError(f"a pool's {len(cached)} cached blocks and their {len(last)} last owners do not fit")
        owner[cached] = last
    free = runs_stack(_values(d["free_runs"], U32)) if "free_runs" in d else _values(d["free"], U32)
    if len(free) and int(free.max()) >= n:
        raise ValueError(f"a free block is outside the pool of {n} blocks")
    return PoolState(tuple(d["shape"]), array("I", ref.tobytes()), array("H", owner.tobytes()), list(d["owners"]),
                     hashed, bytes(d["hashes"]), array("I", free.astype(np.uint32).tobytes()),
                     _values(d["unindexed"], U32).tolist(), eviction, d.get("facts"))


def _state_v2(d: dict) -> PoolState:
    """The second form: the same arrays as base64 strings, the sparse ones zlib-compressed."""
    n = d["shape"][0]
    unb64 = base64.b64decode
    hashed = _values(zlib.decompress(unb64(d["hashed"])), U32)
    used = _values(unb64(d["used"]), U32)
    ref, owner = np.zeros(n, dtype=np.uint32), np.zeros(n, dtype=np.uint16)
    ref[used], owner[used] = _values(unb64(d["ref"]), U32), _values(unb64(d["owner"]), U16)
    return PoolState(tuple(d["shape"]), array("I", ref.tobytes()), array("H", owner.tobytes()), list(d["owners"]),
                     hashed, unb64(d["hashes"]), _array("I", zlib.decompress(unb64(d["free"])), U32),
                     list(d["unindexed"]), {"lru": zlib.decompress(unb64(d["lru"]))})


def _state_v1(d: dict) -> PoolState:
    """The first form: one JSON value per block and field, the index as ``[hash hex, block]``."""
    owners = sorted({t for t in d["owner"] if t is not None})
    code = {t: i + 1 for i, t in enumerate(owners)}
    hashes = [bytes.fromhex(h) if h is not None else None for h in d["hash"]]
    indexed = {b for _, b in d["index"]}
    hashed = [b for b, h in enumerate(hashes) if h is not None]
    return PoolState(tuple(d["shape"]), array("I", d["ref"]), array("H", [code.get(t, 0) for t in d["owner"]]),
                     owners, np.array(hashed, dtype=np.uint32), b"".join(hashes[b] for b in hashed),
                     array("I", d["free"]), [b for b in hashed if b not in indexed],
                     {"lru": np.array(d["cached"], dtype=I32).tobytes()})
