"""Log records: one page-table call per record, in a compact binary form, and their replay.

A record holds the call's arguments, not its results: the page table is deterministic, so replaying
the calls on the state they were made on gives the same block ids. Calls that changed nothing
(refusals, no-op commits) are not logged. Layout, little-endian, ``str`` = u16 length + UTF-8::

    ALLOCATE   op count:u32 (node:str seq:str tenant:str num_tokens:u32 n:u32 hash[16]*n)*count
    EXTEND     op count:u32 (seq:str num_tokens:u32)*count
    COMMIT     op count:u32 (seq:str block_index:u32 hash[16])*count
    RELEASE    op count:u32 (seq:str)*count
    DROP       op count:u32 (seq:str num_blocks:u32)*count      (drop_front: sliding-window blocks)
    REGISTER   op node:str num_blocks:u32 block_size:u32 bytes_per_block:u64
    DEREGISTER op node:str
    TENANTS    op replace_all:u8 json-list-of-tenant-configs
    SYNC       op node:str num_blocks:u32 block_size:u32 bytes_per_block:u64 count:u32
               (seq:str tenant:str num_tokens:u32 n:u32 block:u32*n)*count
    TIERS      op node:str replace:u8 ntenants:u16 tenant:str*ntenants count:u32 hash[16]*count
               code:u32*count    (code = tenant's index * 4 + tier: 0 none, 1 host, 2 disk)
    PIN        op node:str tenant:str expires_at:u64 count:u32 hash[16]*count   (``pins``)
    UNPIN      op node:str count:u32 hash[16]*count     (pins the leader ended: their expiry came)

A TIERS record holds a node's lower-tier moves that were applied (``record_tiers``: the refused ones
left out, so that its replay refuses nothing), or with ``replace`` its whole lower-tier index as
a sync took it (``replace_tiers``). Many moves share one record: ~20 bytes each.

A SYNC record holds the node's list as the page table took it (``SyncResult.listed``: refused
sequences left out, or as they were), so that its replay refuses nothing.

A PIN record holds a pin as the table took it, its expiry absolute, and UNPIN the pins the leader
ended, named: replay reads no clock, so a standby holds and frees the blocks the leader did.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

from kvfleet.block_service.node_sync import LiveSequence
from kvfleet.block_service.page_table import PageTable
from kvfleet.block_service.tenants import tenant_from_record, tenant_to_record
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TIER_NONE, AllocateRequest, Refusal, TierChange
from kvfleet.core.block_hash import HASH_BYTES
from kvfleet.core.tenants import Tenant

ALLOCATE, EXTEND, COMMIT, RELEASE, REGISTER, DEREGISTER, TENANTS, SYNC, DROP, TIERS, PIN, UNPIN = range(1, 13)
OP_NAMES = {ALLOCATE: "allocate", EXTEND: "extend", COMMIT: "commit", RELEASE: "release",
            REGISTER: "register_node", DEREGISTER: "deregister_node", TENANTS: "configure_tenants",
            SYNC: "sync_node", DROP: "drop_front", TIERS: "record_tiers", PIN: "pin", UNPIN: "unpin"}
_TIER_CODES = {TIER_NONE: 0, TIER_HOST: 1, TIER_DISK: 2}
_TIER_NAMES = (TIER_NONE, TIER_HOST, TIER_DISK)

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_OP_COUNT = struct.Struct("<BI")
_TOKENS_NHASH = struct.Struct("<II")
_REGISTER = struct.Struct("<IIQ")


def _s(text: str) -> bytes:
    b = text.encode()
    return _U16.pack(len(b)) + b


def encode_allocate(requests: Sequence[AllocateRequest]) -> bytes:
    parts = [_OP_COUNT.pack(ALLOCATE, len(requests))]
    for r in requests:
        parts += (_s(r.node_id), _s(r.seq_id), _s(r.tenant),
                  _TOKENS_NHASH.pack(r.num_tokens, len(r.block_hashes)), *r.block_hashes)
    return b"".join(parts)


def encode_extend(growth: Sequence[tuple[str, int]], op: int = EXTEND) -> bytes:
    """EXTEND (``(seq, num_tokens)``) or, same layout, DROP (``(seq, num_blocks)``)."""
    parts = [_OP_COUNT.pack(op, len(growth))]
    for seq_id, n in growth:
        parts += (_s(seq_id), _U32.pack(n))
    return b"".join(parts)


def encode_commit(commits: Sequence[tuple[str, int, bytes]]) -> bytes:
    parts = [_OP_COUNT.pack(COMMIT, len(commits))]
    for seq_id, i, h in commits:
        parts += (_s(seq_id), _U32.pack(i), h)
    return b"".join(parts)


def encode_release(seq_ids: Sequence[str]) -> bytes:
    return b"".join([_OP_COUNT.pack(RELEASE, len(seq_ids)), *map(_s, seq_ids)])


def encode_register(node_id: str, num_blocks: int, block_size: int, bytes_per_block: int) -> bytes:
    return bytes([REGISTER]) + _s(node_id) + _REGISTER.pack(num_blocks, block_size, bytes_per_block)


def encode_deregister(node_id: str) -> bytes:
    return bytes([DEREGISTER]) + _s(node_id)


def encode_tenants(configs: Sequence[Tenant], replace_all: bool) -> bytes:
    return bytes([TENANTS, replace_all]) + json.dumps([tenant_to_record(c) for c in configs]).encode()


def encode_sync(node_id: str, num_blocks: int, block_size: int, bytes_per_block: int,
                listed: Sequence[LiveSequence]) -> bytes:
    parts = [bytes([SYNC]), _s(node_id), _REGISTER.pack(num_blocks, block_size, bytes_per_block), _U32.pack(len(listed))]
    for s in listed:
        parts += (_s(s.seq_id), _s(s.tenant), _TOKENS_NHASH.pack(s.num_tokens, len(s.block_ids)),
                  struct.pack(f"<{len(s.block_ids)}I", *s.block_ids))
    return b"".join(parts)


def _decode_sync(r: _Reader) -> tuple:
    r.pos = 1
    node, shape, (count,) = r.str(), r.unpack(_REGISTER), r.unpack(_U32)
    listed = []
    for _ in range(count):
        seq, tenant = r.str(), r.str()
        n, nb = r.unpack(_TOKENS_NHASH)
        listed.append(LiveSequence(seq, tenant, struct.unpack(f"<{nb}I", r.raw(4 * nb)), n))
    return (node, *shape, listed)


def encode_tiers(node_id: str, changes: Sequence[TierChange], replace: bool = False) -> bytes:
    names: dict[str, int] = {}
    codes = [names.setdefault(c.tenant, len(names)) * 4 + _TIER_CODES[c.tier] for c in changes]
    return b"".join([bytes([TIERS]), _s(node_id), bytes([replace]), _U16.pack(len(names)), *map(_s, names),
                     _U32.pack(len(changes)), *(c.block_hash for c in changes),
                     struct.pack(f"<{len(codes)}I", *codes)])


def _decode_tiers(r: _Reader) -> tuple[int, tuple]:
    r.pos = 1
    node, replace = r.str(), r.raw(1)[0]
    (ntenants,) = r.unpack(_U16)
    tenants = [r.str() for _ in range(ntenants)]
    (count,) = r.unpack(_U32)
    hashes = r.raw(HASH_BYTES * count)
    codes = struct.unpack(f"<{count}I", r.raw(4 * count))
    changes = [TierChange(hashes[i * HASH_BYTES:(i + 1) * HASH_BYTES], tenants[v >> 2], _TIER_NAMES[v & 3])
               for i, v in enumerate(codes)]
    return (REPLACE_TIERS if replace else TIERS), (node, changes)


def encode_pin(node_id: str, tenant: str, block_hashes: Sequence[bytes], expires_at: int) -> bytes:
    return b"".join([bytes([PIN]), _s(node_id), _s(tenant), _U64.pack(expires_at), _U32.pack(len(block_hashes)),
                     *block_hashes])


def encode_unpin(node_id: str, block_hashes: Sequence[bytes]) -> bytes:
    return b"".join([bytes([UNPIN]), _s(node_id), _U32.pack(len(block_hashes)), *block_hashes])


def _decode_pin(r: _Reader, op: int) -> tuple:
    r.pos = 1
    node = r.str()
    head = (r.str(), r.unpack(_U64)[0]) if op == PIN else ()
    (count,) = r.unpack(_U32)
    hashes = [r.raw(HASH_BYTES) for _ in range(count)]
    return (node, head[0], hashes, head[1]) if op == PIN else (node, hashes)


REPLACE_TIERS = -TIERS  # a TIERS record with ``replace`` set, as ``decode`` tells it apart


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def unpack(self, st: struct.Struct) -> tuple:
        v = st.unpack_from(self.data, self.pos)
        self.pos += st.size
        return v

    def raw(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("record ends early")
        v = self.data[self.pos : self.pos + n]
        self.pos += n
        return v

    def str(self) -> str:
        (n,) = self.unpack(_U16)
        return self.raw(n).decode()


def decode(payload: bytes) -> tuple[int, tuple]:
    """``(op, args)`` where ``args`` are the arguments of the page-table call."""
    r = _Reader(payload)
    op = payload[0]
    if op in (ALLOCATE, EXTEND, COMMIT, RELEASE, DROP):
        _, count = r.unpack(_OP_COUNT)
        items: list = []
        for _ in range(count):
            if op == ALLOCATE:
                node, seq, tenant = r.str(), r.str(), r.str()
                n, nh = r.unpack(_TOKENS_NHASH)
                hashes = [r.raw(HASH_BYTES) for _ in range(nh)]
                items.append(AllocateRequest(node, seq, tenant, hashes, n))
            elif op in (EXTEND, DROP):
                items.append((r.str(), r.unpack(_U32)[0]))
            elif op == COMMIT:
                items.append((r.str(), r.unpack(_U32)[0], r.raw(HASH_BYTES)))
            else:
                items.append(r.str())
        args: tuple = (items,)
    elif op == REGISTER:
        r.pos = 1
        args = (r.str(), *r.unpack(_REGISTER))
    elif op == DEREGISTER:
        r.pos = 1
        args = (r.str(),)
    elif op == SYNC:
        args = _decode_sync(r)
    elif op == TENANTS:
        args = ([tenant_from_record(c) for c in json.loads(payload[2:])], bool(payload[1]))
    elif op == TIERS:
        op, args = _decode_tiers(r)
    elif op in (PIN, UNPIN):
        args = _decode_pin(r, op)
    else:
        raise ValueError(f"unknown log record type {op}")
    if op != TENANTS and r.pos != len(payload):
        raise ValueError(f"{len(payload) - r.pos} stray bytes after a {OP_NAMES[abs(op)]} record")
    return op, args


def apply(table: PageTable, payload: bytes) -> int:
    """Replay one record on ``table``; returns its op. Raises if the record does not apply."""
    op, args = decode(payload)
    result = getattr(table.pins if op in (PIN, UNPIN) else table, _METHODS[op])(*args)
    if (op in (ALLOCATE, EXTEND) and any(isinstance(x, Refusal) for x in result) or op == SYNC and result.refused
            or op == TIERS and result.refused):
        raise ValueError(f"replayed {OP_NAMES[abs(op)]} was refused: the log does not fit this state")
    return op


_METHODS = {ALLOCATE: "allocate_many", EXTEND: "extend", COMMIT: "commit", RELEASE: "release",
            REGISTER: "register_node", DEREGISTER: "deregister_node", TENANTS: "configure_tenants",
            SYNC: "sync_node", DROP: "drop_front", TIERS: "record_tiers", REPLACE_TIERS: "replace_tiers",
            PIN: "pin", UNPIN: "expire"}
