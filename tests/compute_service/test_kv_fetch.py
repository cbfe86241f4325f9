"""A node imports a tenant's cached prefix from the peer that holds it (``Compute.FetchBlocks`` over a
real gRPC server on loopback, two real engines in this process): byte-identical from every tier of
the holder, float32 and FP8 with its scales, and a generation on the receiver that finds the prefix
cached and gives the tokens it gives without the fetch. Everything that goes wrong on the way
(a block the holder lacks, a corrupted or truncated stream, a layout mismatch, a full pool, an
unreachable or stalled peer) imports only whole verified blocks, and leaks no block."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvfleet.compute_service.engine.async_engine import AsyncEngine
from kvfleet.compute_service.node.kv_fetch import fetch_over
from kvfleet.core import rpc
from kvfleet.core.identity import Identity
from kvfleet.v1 import compute_pb2_grpc
from tests.compute_service.conftest import random_prompt
from tests.compute_service.kv_peers import (
    BS,
    HOLDER,
    OTHERS,
    PROMPT,
    altered,
    counts,
    fetch,
    hashes_of,
    identical,
    make_engine,
    peers,
    per_block,
    rows,
    serve,
)

HASHES = hashes_of(PROMPT, "default", 4)
TIERS = {
    "pool": lambda d, tmp: {},
    "host": lambda d, tmp: dict(kv_host_memory=32 * per_block(d)),
    "disk": lambda d, tmp: dict(kv_host_memory=2 * per_block(d), kv_disk_dir=str(tmp / "kv"),
                                kv_disk_bytes=64 * per_block(d)),
}


def holder_with_prompt(model_dir, tmp_path, tier: str = "pool", kv_cache_dtype: str = "auto"):
    """A holder that served PROMPT, its blocks then left where ``tier`` says; (engine, output,
    PROMPT's blocks' bytes as the forward wrote them)."""
    engine = make_engine(model_dir, 64 if tier == "pool" else 8, kv_cache_dtype, **TIERS[tier](model_dir, tmp_path))
    out = serve(engine, PROMPT)
    written = rows(engine, HASHES)
    assert len(written) == 4
    if tier != "pool":
        for other in OTHERS:  # an 8-block pool: PROMPT's blocks are demoted (and cascade to disk)
            serve(engine, other)
        assert [engine.tiers.index.held(h).tier for h in HASHES] == [tier] * 4
        assert not rows(engine, HASHES)
    return engine, out, written


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("tier", ["pool", "host", "disk"])
def test_a_fetched_prefix_is_byte_identical_and_generates_as_computed(llama_dir, tmp_path, tier, kv_cache_dtype):
    holder, computed, written = holder_with_prompt(llama_dir, tmp_path, tier, kv_cache_dtype)
    receiver = make_engine(llama_dir, 64, kv_cache_dtype)
    cold = make_engine(llama_dir, 64, kv_cache_dtype)
    assert fetch(holder, receiver, "default", HASHES) == 4
    assert counts(receiver) == (60, 4, 0)
    fetched = rows(receiver, HASHES)
    assert fetched.keys() == written.keys()
    assert all(identical(fetched[h], written[h]) for h in HASHES)
    if kv_cache_dtype == "fp8_e4m3":
        assert all(fetched[h][1] is not None for h in HASHES)  # scales came too
    receiver.allocator.page_table.check()

    out = serve(receiver, PROMPT)
    assert out.cached_tokens == 4 * BS
    # without the fetch: the same prompt on a node that computes it, then served from its own cache
    alone = serve(cold, PROMPT)
    again = serve(cold, PROMPT)
    assert again.cached_tokens == 4 * BS
    assert out.new_token_ids == again.new_token_ids
    if kv_cache_dtype == "auto":  # float32: the cached prefix changes nothing
        assert out.new_token_ids == alone.new_token_ids == computed.new_token_ids


def test_a_holder_registered_by_the_generated_code_serves_the_same_blocks_as_messages(llama_dir, tmp_path):
    holder, _, written = holder_with_prompt(llama_dir, tmp_path, kv_cache_dtype="fp8_e4m3")
    receiver = make_engine(llama_dir, 64, "fp8_e4m3")
    assert fetch(holder, receiver, "default", HASHES, register=compute_pb2_grpc.add_ComputeServicer_to_server) == 4
    fetched = rows(receiver, HASHES)
    assert fetched.keys() == written.keys() and all(identical(fetched[h], written[h]) for h in HASHES)


def test_the_holder_serves_the_leading_run_it_has_and_the_receiver_asks_only_for_what_it_lacks(llama_dir, tmp_path):
    holder, _, _ = holder_with_prompt(llama_dir, tmp_path)
    receiver = make_engine(llama_dir, 64)
    longer = PROMPT[:4 * BS] + random_prompt(3 * BS, seed=90)  # PROMPT's 4 blocks, then 3 the holder lacks
    assert hashes_of(longer, "default")[:4] == HASHES
    assert fetch(holder, receiver, "default", hashes_of(longer, "default")) == 4
    assert counts(receiver) == (60, 4, 0)

    unknown = hashes_of(random_prompt(3 * BS, seed=91), "default")
    assert fetch(holder, receiver, "default", unknown) == 0
    assert counts(receiver) == (60, 4, 0)

    asked = []

    def record(call):
        def stream(request, timeout=None):
            asked.append(len(request.block_hashes) // 16)
            return call(request, timeout=timeout)
        return stream

    assert fetch(holder, receiver, "default", hashes_of(longer, "default"), wrap=record) == 4
    assert asked == [3]  # the 4 it holds are not asked for again; the holder has none of the rest
    assert counts(receiver) == (60, 4, 0)
    receiver.allocator.page_table.check()


def flip_byte_of_block(block: int, in_chunk: int = 0):
    def change(i, chunk):
        if i != in_chunk:
            return chunk
        data = bytearray(chunk.kv)
        data[block * len(chunk.kv) // len(chunk.checksums) + 7] ^= 0x10
        chunk.kv = bytes(data)
        return chunk
    return change


def first_blocks_only(keep: int):
    def change(i, chunk):
        per_kv = len(chunk.kv) // len(chunk.checksums)
        chunk.kv = chunk.kv[:keep * per_kv]
        chunk.block_hashes = chunk.block_hashes[:keep * 16]
        del chunk.checksums[keep:]
        return chunk
    return change


def header_says(**fields):
    def change(i, chunk):
        for name, value in fields.items():
            setattr(chunk.header, name, value)
        return chunk
    return change


def truncated_after(chunks: int):
    return lambda i, chunk: chunk if i < chunks else None


ONE_BLOCK = 1  # max_chunk_bytes: one block per chunk (a chunk holds at least one)


@pytest.mark.parametrize("change, chunk_bytes, imported, why", [
    (flip_byte_of_block(2), 0, 2, "block 2 fails its checksum"),
    (flip_byte_of_block(0), 0, 0, "block 0 fails its checksum"),
    (flip_byte_of_block(0, in_chunk=1), ONE_BLOCK, 1, "block 1 fails its checksum"),
    (first_blocks_only(3), 0, 3, "the stream ended after 3 of the 4 blocks"),
    (truncated_after(2), ONE_BLOCK, 2, "the stream ended after 2 of the 4 blocks"),
    (header_says(block_size=32), 0, 0, "block_size 16 here, 32 at the peer"),
    (header_says(kv_cache_dtype="bfloat16"), 0, 0, "kv_cache_dtype float32 here, bfloat16 at the peer"),
    (truncated_after(0), 0, 0, "the stream ended before its header"),
])
def test_a_bad_stream_imports_only_the_verified_blocks_before_the_fault(llama_dir, tmp_path, caplog, change,
                                                                         chunk_bytes, imported, why):
    holder, _, written = holder_with_prompt(llama_dir, tmp_path)
    receiver = make_engine(llama_dir, 64)
    holder_counts = counts(holder)
    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.kv_fetch"):
        assert fetch(holder, receiver, "default", HASHES, wrap=altered(change, chunk_bytes)) == imported
    assert counts(receiver) == (64 - imported, imported, 0)
    assert counts(holder) == holder_counts
    got = rows(receiver, HASHES)
    assert list(got) == HASHES[:imported]
    assert all(identical(got[h], written[h]) for h in got)
    receiver.allocator.page_table.check()
    [line] = [r.getMessage() for r in caplog.records]
    assert why in line and f"imported {imported}" in line and "\n" not in line


def test_a_pool_that_cannot_take_the_run_refuses_before_any_transfer(llama_dir, tmp_path, caplog):
    holder, _, _ = holder_with_prompt(llama_dir, tmp_path)
    receiver = make_engine(llama_dir, 3)
    asked = []

    def record(call):
        def stream(request, timeout=None):
            asked.append(request)
            return call(request, timeout=timeout)
        return stream

    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.kv_fetch"):
        assert fetch(holder, receiver, "default", HASHES, wrap=record) == 0
    assert asked == []
    assert counts(receiver) == (3, 0, 0)
    assert "no blocks here" in caplog.text


def test_an_unreachable_or_stalled_peer_imports_nothing_and_leaks_nothing(llama_dir, tmp_path, caplog):
    holder, _, _ = holder_with_prompt(llama_dir, tmp_path)
    receiver = make_engine(llama_dir, 64)
    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.kv_fetch"):
        assert fetch(holder, receiver, "default", HASHES, address="127.0.0.1:1", deadline_s=10) == 0
    assert "UNAVAILABLE" in caplog.text
    assert counts(receiver) == (64, 0, 0)

    def stall(call):
        async def stream(request, timeout=None):
            await asyncio.sleep(60)  # a holder that never answers: the deadline ends it
            yield  # pragma: no cover
        return stream

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.kv_fetch"):
        assert fetch(holder, receiver, "default", HASHES, wrap=stall, deadline_s=0.5) == 0
    assert "deadline" in caplog.text
    assert counts(receiver) == (64, 0, 0)
    receiver.allocator.page_table.check()


def test_a_fetch_asking_on_a_channel_closed_under_it_imports_nothing_and_leaks_nothing(llama_dir, tmp_path, caplog):
    """Seen in a chaos run: one fetch found its killed peer gone and dropped the channel kept to it;
    another fetch, which had taken that channel already, then asked on it closed. That is the peer's
    failure like any other (the request prefills instead), not an exception that left it unstarted."""
    holder, _, _ = holder_with_prompt(llama_dir, tmp_path)
    receiver = make_engine(llama_dir, 64)

    async def main():
        async with peers(holder, receiver) as (served_at, r):
            channel = rpc.channel(served_at, peer=Identity.node(HOLDER))
            await channel.close()  # the real thing: gRPC refuses a call on it at once
            return await fetch_over(compute_pb2_grpc.ComputeStub(channel).FetchBlocks, "a closed channel", "default",
                                    HASHES, r, 10)

    with caplog.at_level(logging.WARNING, logger="kvfleet.compute_service.node.kv_fetch"):
        got = asyncio.run(main())
    assert (got.blocks, got.reason) == (0, "peer")
    assert "closed" in caplog.text
    assert counts(receiver) == (64, 0, 0)
    receiver.allocator.page_table.check()


def test_cached_blocks_the_import_takes_are_demoted_to_the_receivers_host_tier(llama_dir, tmp_path):
    holder, _, _ = holder_with_prompt(llama_dir, tmp_path)
    receiver = make_engine(llama_dir, 8, kv_host_memory=32 * per_block(llama_dir))
    serve(receiver, OTHERS[0])  # 7 blocks: 6 committed, cached once it finishes
    mine = hashes_of(OTHERS[0], "default")
    assert receiver.tiers.counts().host_used == 0
    assert fetch(holder, receiver, "default", HASHES) == 4
    assert counts(receiver) == (0, 8, 0)
    demoted = [h for h in mine if receiver.tiers.index.held(h) is not None]
    assert len(demoted) >= 2  # the pool's free blocks went first, then cached ones, kept in host
    assert len(rows(receiver, HASHES)) == 4


def test_a_fetch_cancelled_mid_stream_leaks_no_block(llama_dir, tmp_path):
    holder, _, _ = holder_with_prompt(llama_dir, tmp_path)
    receiver = make_engine(llama_dir, 64)

    async def main():
        started = asyncio.Event()

        async def stalled(request, timeout=None):
            started.set()
            await asyncio.sleep(60)
            yield  # pragma: no cover

        async with peers(holder, receiver) as (_, engine):
            task = asyncio.create_task(fetch_over(stalled, "a stalled double", "default", HASHES, engine, 30))
            await started.wait()  # the pool's blocks are taken: the stream is being read
            assert await engine.call(counts) == (60, 0, 4)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await engine.call(counts)

    assert asyncio.run(main()) == (64, 0, 0)


def test_a_fetch_waits_on_the_receivers_engine_twice_and_a_refused_or_held_one_once(llama_dir, tmp_path, monkeypatch):
    """Each call waits for the step in progress (on a loaded node, most of a small fetch): the open,
    then the commit with the release; a fetch that moves nothing makes only the open."""
    holder, _, _ = holder_with_prompt(llama_dir, tmp_path)
    receiver, full = make_engine(llama_dir, 64), make_engine(llama_dir, 3)
    calls = []
    real_call = AsyncEngine.call

    def counted(self, fn):
        calls.append(self.engine)
        return real_call(self, fn)

    monkeypatch.setattr(AsyncEngine, "call", counted)
    assert fetch(holder, receiver, "default", HASHES) == 4
    assert calls.count(receiver) == 2
    assert fetch(holder, receiver, "default", HASHES) == 4  # every block held already
    assert fetch(holder, full, "default", HASHES) == 0      # refused: no room
    assert (calls.count(receiver), calls.count(full)) == (3, 1)
    assert counts(receiver) == (60, 4, 0) and counts(full) == (3, 0, 0)
