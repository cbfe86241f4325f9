"""A ``BlockChunk`` written and read by hand (node/chunk_wire.py) is the protobuf the generated code
writes and reads: byte-equal both ways, any valid encoding parsed, a broken one refused in a line.
And the two threads a fetch's bytes pass through on their way: the holder makes no frame past the
one being made when its caller leaves; the receiver's wait for a feed ends only with the feed."""

from __future__ import annotations

import asyncio
import struct
import threading
import time

import pytest

from kvfleet.compute_service.node import chunk_wire
from kvfleet.compute_service.node.kv_fetch import _feed
from kvfleet.compute_service.node.kv_holder import _made_ahead
from kvfleet.v1 import compute_pb2 as pb

HEADER = pb.BlockRunHeader(kv_cache_dtype="bfloat16", block_size=16, num_layers=2, num_kv_heads=1, head_dim=8,
                           blocks=[pb.BlockOrigin(parent_hash=b"", token_ids=list(range(16)), extra=b"t")])
KV, SCALES = bytes(range(256)) * 3, b"\x01\x02\x03\x04" * 5


@pytest.mark.parametrize("header, scales, checksums", [
    (HEADER, SCALES, [0, 1, 0xFFFFFFFF]),
    (None, b"", [7]),
    (pb.BlockRunHeader(), b"", []),  # an empty header is still a header (the run of no blocks has one)
])
def test_a_frame_is_byte_equal_to_the_generated_serialization_and_reads_back(header, scales, checksums):
    message = pb.BlockChunk(block_hashes=b"h" * 32, kv=KV, scales=scales, checksums=checksums)
    if header is not None:
        message.header.CopyFrom(header)
    data = chunk_wire.frame(header.SerializeToString() if header is not None else None, b"h" * 32,
                            memoryview(KV), scales, checksums)
    assert data == message.SerializeToString()
    chunk = chunk_wire.parse(data)
    assert (chunk.header is not None) == message.HasField("header")
    assert chunk.header is None or chunk.header == header
    assert (chunk.block_hashes, bytes(chunk.kv), bytes(chunk.scales), chunk.checksums) == \
           (b"h" * 32, KV, scales, checksums)


def key(number: int, wire: int) -> bytes:
    return bytes([number << 3 | wire])


def test_any_valid_encoding_parses_as_protobuf_would():
    # fields out of order, checksums unpacked, a repeated header (merged), unknown fields of each wire type
    half = pb.BlockRunHeader(block_size=16).SerializeToString(), pb.BlockRunHeader(head_dim=8).SerializeToString()
    data = b"".join([
        key(3, 2), bytes([4]), b"kvkv",
        key(5, 5), struct.pack("<I", 9), key(5, 5), struct.pack("<I", 10),
        key(1, 2), bytes([len(half[0])]), half[0],
        key(9, 0), b"\x96\x01", key(10, 1), b"\0" * 8, key(11, 5), b"\0" * 4, key(12, 2), b"\x01z",
        key(1, 2), bytes([len(half[1])]), half[1],
        key(2, 2), bytes([2]), b"hh",
    ])
    ours, theirs = chunk_wire.parse(data), pb.BlockChunk.FromString(data)
    assert ours.header == theirs.header and ours.header.block_size == 16 and ours.header.head_dim == 8
    assert (ours.block_hashes, bytes(ours.kv), bytes(ours.scales), ours.checksums) == \
           (theirs.block_hashes, theirs.kv, theirs.scales, list(theirs.checksums)) == (b"hh", b"kvkv", b"", [9, 10])


@pytest.mark.parametrize("data, why", [
    (key(3, 2) + bytes([10]) + b"short", "field 3 runs 5 bytes past the frame's end"),
    (key(3, 2) + b"\x80", "a varint is cut short"),
    (key(5, 2) + bytes([3]) + b"abc", "packed checksums of 3 bytes"),
    (key(5, 5) + b"ab", "field 5 of wire type 5 is cut short"),
    (key(3, 3), "field 3 of wire type 3"),
    (key(1, 2) + bytes([2]) + b"\xff\xff", "its header is not a BlockRunHeader"),
])
def test_a_broken_frame_is_refused_in_one_line(data, why):
    with pytest.raises(ValueError, match=why):
        chunk_wire.parse(data)


def test_the_holder_makes_no_frame_past_the_one_under_way_when_its_caller_leaves():
    made = []

    def frames():
        for i in range(100):
            made.append(i)
            yield bytes([i])

    async def main():
        taken = []
        async for data in _made_ahead(frames()):
            taken.append(data)
            if len(taken) == 3:
                break  # the caller went away: the generator is closed
        await asyncio.sleep(0.05)  # a frame still being made would finish now
        return taken

    assert asyncio.run(main()) == [b"\0", b"\1", b"\2"]
    assert made == [0, 1, 2, 3]  # the one made ahead, and no more


def test_a_feed_cut_short_has_ended_before_the_wait_gives_up():
    began, ended = threading.Event(), threading.Event()

    class SlowReader:
        def feed(self, chunk):
            began.set()
            time.sleep(0.3)
            ended.set()

    async def main():
        task = asyncio.create_task(_feed(SlowReader(), b""))
        await asyncio.to_thread(began.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ended.is_set()

    assert asyncio.run(main())  # a cancelled wait returns only once the chunk's feed is over
