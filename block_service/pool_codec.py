"""A pool in a snapshot: its arrays as they are in memory, compressed, in the JSON of the state.

    {"shape": [num_blocks, block_size, bytes_per_block], "v": 2,
     "ref": Z(uint32[]), "owner": Z(uint16[]), "owners": [tenant, ...], "free": Z(uint32[]),
     "lru": [head, tail, size, Z(int32[] prev), Z(int32[] next)],
     "hashed": Z(uint32[] blocks holding a hash, ascending), "hashes": B64(their hashes, concatenated),
     "unindexed": [blocks whose hash the node indexes at another block]}

    Z(a) = base64(zlib(a's bytes, little-endian)), B64 = base64

At 100,000 blocks a pool is a few hundred KB instead of the ~5 MB of one JSON number or ``null`` per
block per field, and it is written and read without a Python object per block (issue 19: snapshot and
recovery of 1,000 such pools in under a minute). Snapshots of the first format (``"ref"`` a JSON list)
still load.
"""

from __future__ import annotations

import base64
import sys
import zlib
from array import array
from collections import deque
from itertools import compress

from block_service.block_lru import BlockLru
from block_service.block_pool import BlockPool, PoolState
from block_service.prefix_index import PrefixIndex
from kvfleet.block_hash import HASH_BYTES

_SWAP = sys.byteorder != "little"


def _z(a: array) -> str:
    if _SWAP:
        a = array(a.typecode, a)
        a.byteswap()
    return base64.b64encode(zlib.compress(a.tobytes(), 1)).decode("ascii")


def _unz(typecode: str, text: str) -> array:
    a = array(typecode)
    a.frombytes(zlib.decompress(base64.b64decode(text)))
    if _SWAP:
        a.byteswap()
    return a


def pool_to_dict(pool: BlockPool) -> dict:
    s = pool.state()
    hashed = array("I", compress(range(len(s.hash)), s.hash))  # the blocks whose hash is not None
    prev, next_, head, tail, size = s.lru
    return {
        "shape": list(s.shape), "v": 2, "ref": _z(s.ref), "owner": _z(s.owner), "owners": list(s.owners),
        "free": _z(s.free), "lru": [head, tail, size, _z(prev), _z(next_)], "hashed": _z(hashed),
        "hashes": base64.b64encode(b"".join(filter(None, s.hash))).decode("ascii"), "unindexed": s.unindexed,
    }


def pool_from_dict(d: dict, index: PrefixIndex | None = None, slot: int = 0) -> BlockPool:
    state = _state_v2(d) if d.get("v") == 2 else _state_v1(d)
    return BlockPool.from_state(state, index, slot)


def _state_v2(d: dict) -> PoolState:
    num_blocks = d["shape"][0]
    hashed, data = _unz("I", d["hashed"]), base64.b64decode(d["hashes"])
    assert len(data) == HASH_BYTES * len(hashed), "hashes and their blocks differ in number"
    hashes: list[bytes | None] = [None] * num_blocks
    chunks = [data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES)]
    deque(map(hashes.__setitem__, hashed, chunks), maxlen=0)  # hashes[b] = chunk, in C
    head, tail, size, prev, next_ = d["lru"]
    return PoolState(tuple(d["shape"]), _unz("I", d["ref"]), _unz("H", d["owner"]), list(d["owners"]), hashes,
                     _unz("I", d["free"]), (_unz("i", prev), _unz("i", next_), head, tail, size),
                     list(d["unindexed"]))


def _state_v1(d: dict) -> PoolState:
    """The first format: one JSON value per block and field, the index as ``[hash hex, block]``."""
    num_blocks = d["shape"][0]
    owners = sorted({t for t in d["owner"] if t is not None})
    code = {t: i + 1 for i, t in enumerate(owners)}
    hashes = [bytes.fromhex(h) if h is not None else None for h in d["hash"]]
    indexed = {b for _, b in d["index"]}
    lru = BlockLru.from_order(num_blocks, d["cached"]).links()
    return PoolState(tuple(d["shape"]), array("I", d["ref"]), array("H", [code.get(t, 0) for t in d["owner"]]),
                     owners, hashes, array("I", d["free"]), lru,
                     [b for b, h in enumerate(hashes) if h is not None and b not in indexed])
