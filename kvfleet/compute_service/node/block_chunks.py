"""A fetched run of KV blocks on the wire (``Compute.FetchBlocks``, compute.proto): the holder's rows
cut into ``BlockChunk`` frames, and the receiver's checks on them.

    holder:   rows [n, *row] ─▶ chunks of whole blocks ≤ max_chunk_bytes, the first with the header,
              each chunk's CRC-32s taken as it is framed (node/chunk_wire.py: the bytes, by hand)
    receiver: header (layout equal to its pool's, every name hashing to the hash it asked for)
              ─▶ each chunk (the next hashes in order, whole rows, each row's CRC-32) ─▶ a buffer

A receiver keeps only whole, verified blocks: the first block that fails a check ends the run there
(``TransferRefused``, one line), and the blocks before it are still good to import. The row bytes
are copied once on each side: into the frame (its checksums taken first), and out of it into the
receiver's buffer (checked as they are copied).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvfleet.compute_service.kv.block_rows import BlockRows, RowLayout
from kvfleet.compute_service.kv.held_run import HeldBlock
from kvfleet.compute_service.node import chunk_wire
from kvfleet.core.block_hash import HASH_BYTES, next_block_hash
from kvfleet.v1 import compute_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 << 20


class TransferRefused(Exception):
    """A run the receiver stops taking; ``str()`` says why in one line."""


def split_hashes(raw: bytes) -> list[bytes]:
    """``FetchBlocksRequest.block_hashes`` as a list; ``ValueError`` when not whole 16-byte hashes."""
    if len(raw) % HASH_BYTES:
        raise ValueError(f"block_hashes has {len(raw)} bytes, not a whole number of {HASH_BYTES}-byte hashes")
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]


def frames(layout: RowLayout, blocks: Sequence[HeldBlock], rows: BlockRows, max_chunk_bytes: int,
           checksums: Sequence[int] | None = None) -> Iterator[bytes]:
    """The run as frames of whole blocks, at most ``max_chunk_bytes`` of rows each (at least one
    block), each chunk's checksums computed as it is framed (``checksums``: given instead); a run
    of no blocks is one frame with the header alone."""
    header = pb.BlockRunHeader(kv_cache_dtype=layout.kv_cache_dtype, block_size=layout.block_size,
                               num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                               head_dim=layout.head_dim,
                               blocks=[pb.BlockOrigin(parent_hash=b.parent_hash, token_ids=b.token_ids, extra=b.extra)
                                       for b in blocks]).SerializeToString()
    n = len(blocks)
    if n == 0:
        yield chunk_wire.frame(header, b"", b"", b"", ())
        return
    per_chunk = max(1, max_chunk_bytes // (layout.kv_bytes + layout.scale_bytes))
    kv, scales = rows.row_bytes()
    for start in range(0, n, per_chunk):
        end = min(n, start + per_chunk)
        crcs = rows.checksums(start, end) if checksums is None else checksums[start:end]
        yield chunk_wire.frame(header if start == 0 else None, b"".join(b.block_hash for b in blocks[start:end]),
                               kv[start:end], scales[start:end] if scales is not None else b"", crcs)


def encode(layout: RowLayout, blocks: Sequence[HeldBlock], rows: BlockRows, checksums: list[int],
           max_chunk_bytes: int) -> Iterator[pb.BlockChunk]:
    """The same frames as the messages a reader of the generated stub gets."""
    for data in frames(layout, blocks, rows, max_chunk_bytes, checksums):
        yield pb.BlockChunk.FromString(data)


@dataclass(slots=True, frozen=True)
class FetchedBlock:
    """A block's name as the holder sent it (checked against the hash the receiver asked for)."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: tuple[int, ...]
    extra: bytes
    hits: int = 0


class RunReader:
    """The receiver's side of one stream: it asked for ``hashes[start:]`` (``hashes[:start]`` its
    pool holds already) and keeps the leading blocks that pass every check."""

    def __init__(self, layout: RowLayout, seed: bytes, hashes: Sequence[bytes], start: int) -> None:
        self.layout, self.seed = layout, seed
        self.parent = hashes[start - 1] if start else b""
        self.asked = list(hashes[start:])
        self.blocks: list[FetchedBlock] | None = None  # the run the header names (None: no header yet)
        self.verified = 0                              # leading blocks whose bytes passed every check
        self._kv = np.empty(0, dtype=np.uint8)
        self._scales = np.empty(0, dtype=np.uint8)

    def feed(self, data: bytes | pb.BlockChunk) -> None:
        """Take one chunk (a frame, or a message: a test's double); ``TransferRefused`` at the first
        check it fails (blocks before it kept)."""
        try:
            chunk = chunk_wire.parse(data if isinstance(data, bytes) else data.SerializeToString())
        except ValueError as e:
            raise TransferRefused(f"a chunk that does not decode ({e})") from None
        if self.blocks is None:
            if chunk.header is None:
                raise TransferRefused("its first chunk carries no header")
            self._take_header(chunk.header)
        elif chunk.header is not None:
            raise TransferRefused("a chunk after the first carries a header")
        self._take_rows(chunk)

    def finish(self) -> None:
        """The stream ended: ``TransferRefused`` if it ended before the run the header named."""
        if self.blocks is None:
            raise TransferRefused("the stream ended before its header")
        if self.verified < len(self.blocks):
            raise TransferRefused(f"the stream ended after {self.verified} of the {len(self.blocks)} blocks "
                                  "its header named")

    def rows(self) -> BlockRows:
        """The verified blocks' rows (views of the received bytes)."""
        n, layout = self.verified, self.layout
        if n == 0:
            return BlockRows(torch.empty((0, *layout.row_shape), dtype=layout.dtype), None)
        kv = torch.from_numpy(self._kv[:n * layout.kv_bytes])
        scales = torch.from_numpy(self._scales[:n * layout.scale_bytes]) if layout.scale_bytes else None
        return BlockRows(kv.view(layout.dtype).reshape(n, *layout.row_shape),
                         None if scales is None else scales.view(torch.float32).reshape(n, *layout.row_shape[:4]))

    def _take_header(self, header: pb.BlockRunHeader) -> None:
        theirs = RowLayout(header.kv_cache_dtype, header.block_size, header.num_layers, header.num_kv_heads,
                           header.head_dim)
        mismatch = self.layout.mismatch(theirs)
        if mismatch is not None:
            raise TransferRefused(f"its blocks are laid out otherwise: {mismatch}")
        if len(header.blocks) > len(self.asked):
            raise TransferRefused(f"its header names {len(header.blocks)} blocks, {len(self.asked)} were asked for")
        blocks, parent = [], self.parent
        for i, origin in enumerate(header.blocks):  # names, not bytes: one 64-byte hash per block
            tokens = tuple(origin.token_ids)
            if origin.parent_hash != parent or len(tokens) != self.layout.block_size or \
                    next_block_hash(parent, tokens, origin.extra, self.seed) != self.asked[i]:
                raise TransferRefused(f"its header's block {i} is not the block asked for (its name does not hash to it)")
            blocks.append(FetchedBlock(self.asked[i], parent, tokens, origin.extra if not parent else b""))
            parent = self.asked[i]
        self.blocks = blocks
        self._kv = np.empty(len(blocks) * self.layout.kv_bytes, dtype=np.uint8)  # huge pages: see host_empty
        self._scales = np.empty(len(blocks) * self.layout.scale_bytes, dtype=np.uint8)

    def _take_rows(self, chunk: chunk_wire.Chunk) -> None:
        layout, first = self.layout, self.verified
        n = len(chunk.checksums)
        if first + n > len(self.blocks):
            raise TransferRefused(f"it sends more blocks than the {len(self.blocks)} its header named")
        want = b"".join(b.block_hash for b in self.blocks[first:first + n])
        if chunk.block_hashes != want:
            raise TransferRefused(f"its chunk of {n} blocks after block {first} does not carry the blocks asked for, in order")
        if len(chunk.kv) != n * layout.kv_bytes or len(chunk.scales) != n * layout.scale_bytes:
            raise TransferRefused(f"its chunk after block {first} is not {n} whole blocks")
        kv, scales, kv_bytes, scale_bytes = chunk.kv, chunk.scales, layout.kv_bytes, layout.scale_bytes
        for i, crc in enumerate(chunk.checksums):  # a block's bytes land in its place, counted once they check
            at = first + i
            got = _copied(self._kv, at * kv_bytes, kv[i * kv_bytes:(i + 1) * kv_bytes], 0)
            if _copied(self._scales, at * scale_bytes, scales[i * scale_bytes:(i + 1) * scale_bytes], got) != crc:
                raise TransferRefused(f"block {at} fails its checksum")
            self.verified += 1


_PIECE = 256 << 10  # bytes checked then copied while still in the CPU's cache


def _copied(into: np.ndarray, at: int, data: memoryview, crc: int) -> int:
    """``data`` copied to ``into[at:]``; ``crc`` continued over it (``row_checksum``: the CRC-32 of
    the KV bytes, continued over the scale bytes). Piece by piece, the copy reads what the checksum
    just read: 1.4x the speed of a checksum pass and then a copy pass on this project's CPU."""
    for start in range(0, len(data), _PIECE):
        piece = data[start:start + _PIECE]
        crc = zlib.crc32(piece, crc)
        into[at + start:at + start + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
    return crc
