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

A SYNC record holds the node's list as the page table took it (``SyncResult.listed``: refused
sequences left out, or as they were), so that its replay refuses nothing.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

from block_service.node_sync import LiveSequence
from block_service.page_table import PageTable
from block_service.tenants import tenant_from_record, tenant_to_record
from kvfleet.allocator import AllocateRequest, Refusal
from kvfleet.block_hash import HASH_BYTES
from kvfleet.tenants import Tenant

ALLOCATE, EXTEND, COMMIT, RELEASE, REGISTER, DEREGISTER, TENANTS, SYNC, DROP = range(1, 10)
OP_NAMES = {ALLOCATE: "allocate", EXTEND: "extend", COMMIT: "commit", RELEASE: "release",
            REGISTER: "register_node", DEREGISTER: "deregister_node", TENANTS: "configure_tenants",
            SYNC: "sync_node", DROP: "drop_front"}

_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
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
    else:
        raise ValueError(f"unknown log record type {op}")
    if op != TENANTS and r.pos != len(payload):
        raise ValueError(f"{len(payload) - r.pos} stray bytes after a {OP_NAMES[op]} record")
    return op, args


def apply(table: PageTable, payload: bytes) -> int:
    """Replay one record on ``table``; returns its op. Raises if the record does not apply."""
    op, args = decode(payload)
    result = getattr(table, _METHODS[op])(*args)
    if op in (ALLOCATE, EXTEND) and any(isinstance(x, Refusal) for x in result) or op == SYNC and result.refused:
        raise ValueError(f"replayed {OP_NAMES[op]} was refused: the log does not fit this state")
    return op


_METHODS = {ALLOCATE: "allocate_many", EXTEND: "extend", COMMIT: "commit", RELEASE: "release",
            REGISTER: "register_node", DEREGISTER: "deregister_node", TENANTS: "configure_tenants",
            SYNC: "sync_node", DROP: "drop_front"}
