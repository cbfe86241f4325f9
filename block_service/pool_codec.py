"""A pool in a snapshot: its arrays as they are in memory, compressed, in the JSON of the state.

    {"shape": [num_blocks, block_size, bytes_per_block], "v": 2,
     "used": B(uint32[] blocks with a reference), "ref": B(uint32[] their counts),
     "owner": B(uint16[] their tenants: 1 + an index into "owners"), "owners": [tenant, ...],
     "free": Z(uint32[] the free stack), "lru": Z(int32[] cached blocks, least recently used first),
     "hashed": Z(uint32[] blocks holding a hash, ascending), "hashes": B(their hashes, concatenated),
     "unindexed": [blocks whose hash the node indexes at another block]}

    B(a) = base64(a's bytes, little-endian), Z(a) = base64(zlib(a's bytes, little-endian))

Only what is not the default is written (free blocks have no reference, no owner, no hash), so a
pool 20% cached is ~0.6 MB at 100,000 blocks instead of the ~3 MB of one JSON value per block and
field, and the arrays are written and read by C loops (``compress``, ``map`` over ``__setitem__``),
not a Python statement per block (issue 19: snapshot and recovery of 1,000 such pools in under a
minute). Snapshots of the first format (``"ref"`` a JSON list)
still load.
"""

from __future__ import annotations

import base64
import sys
import zlib
from array import array
from collections import deque
from itertools import compress

from block_service.block_pool import BlockPool, PoolState
from block_service.prefix_index import PrefixIndex
from kvfleet.block_hash import HASH_BYTES

_SWAP = sys.byteorder != "little"


def _b64(a: array) -> str:
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return base64.b64encode(a.tobytes()).decode("ascii")


def _z(a: array) -> str:
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return base64.b64encode(zlib.compress(a.tobytes(), 1)).decode("ascii")


def _array(typecode: str, raw: bytes) -> array:
    a = array(typecode)
    a.frombytes(raw)
    if _SWAP:
        a.byteswap()
    return a


def _scatter(target: array, at: array, values: array) -> None:
    """``target[at[i]] = values[i]`` for every ``i``, in C."""
    deque(map(target.__setitem__, at, values), maxlen=0)


def pool_to_dict(pool: BlockPool) -> dict:
    s = pool.state()
    used = array("I", compress(range(len(s.ref)), s.ref))  # the blocks with a reference
    hashed = array("I", compress(range(len(s.hash)), s.hash))  # the blocks whose hash is not None
    return {
        "shape": list(s.shape), "v": 2, "used": _b64(used), "ref": _b64(array("I", map(s.ref.__getitem__, used))),
        "owner": _b64(array("H", map(s.owner.__getitem__, used))), "owners": list(s.owners),
        "free": _z(s.free), "lru": _z(s.lru), "hashed": _z(hashed),
        "hashes": base64.b64encode(b"".join(filter(None, s.hash))).decode("ascii"), "unindexed": s.unindexed,
    }


def pool_from_dict(d: dict, index: PrefixIndex | None = None, slot: int = 0) -> BlockPool:
    state = _state_v2(d) if d.get("v") == 2 else _state_v1(d)
    return BlockPool.from_state(state, index, slot)


def _state_v2(d: dict) -> PoolState:
    num_blocks = d["shape"][0]
    unb64 = base64.b64decode
    hashed, data = _array("I", zlib.decompress(unb64(d["hashed"]))), unb64(d["hashes"])
    if len(data) != HASH_BYTES * len(hashed):
        raise ValueError(f"a pool's hashes and their blocks differ in number ({len(data)} bytes, {len(hashed)} blocks)")
    hashes: list[bytes | None] = [None] * num_blocks
    chunks = map(data.__getitem__, map(slice, range(0, len(data), HASH_BYTES), range(HASH_BYTES, len(data) + 1, HASH_BYTES)))
    deque(map(hashes.__setitem__, hashed, chunks), maxlen=0)  # hashes[b] = chunk, in C
    used = _array("I", unb64(d["used"]))
    ref, owner = array("I", bytes(4 * num_blocks)), array("H", bytes(2 * num_blocks))
    _scatter(ref, used, _array("I", unb64(d["ref"])))
    _scatter(owner, used, _array("H", unb64(d["owner"])))
    return PoolState(tuple(d["shape"]), ref, owner, list(d["owners"]), hashes,
                     _array("I", zlib.decompress(unb64(d["free"]))), _array("i", zlib.decompress(unb64(d["lru"]))),
                     list(d["unindexed"]))


def _state_v1(d: dict) -> PoolState:
    """The first format: one JSON value per block and field, the index as ``[hash hex, block]``."""
    owners = sorted({t for t in d["owner"] if t is not None})
    code = {t: i + 1 for i, t in enumerate(owners)}
    hashes = [bytes.fromhex(h) if h is not None else None for h in d["hash"]]
    indexed = {b for _, b in d["index"]}
    return PoolState(tuple(d["shape"]), array("I", d["ref"]), array("H", [code.get(t, 0) for t in d["owner"]]),
                     owners, hashes, array("I", d["free"]), array("i", d["cached"]),
                     [b for b, h in enumerate(hashes) if h is not None and b not in indexed])
