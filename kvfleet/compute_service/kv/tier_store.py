"""The node's lower KV tiers in action: ``TierIndex``'s plans performed on real tensors and files.

``KVCacheManager`` calls it at the points where the pool changes hands (see kv/tier_index.py):

    a committed block handed fresh (allocate, grow) ──▶ demote(blocks)        pool -> host (-> disk)
    admission, past the hot prefix                  ──▶ promote(hashes, ids)  host/disk -> pool
    a victim preempted                               ──▶ swap_out(seq)         pool -> host, by seq id
    the victim re-admitted                           ──▶ swap_in(seq, cached)  host -> pool

All of it happens while the scheduler plans a step, before the forward writes any block, so a
block's bytes are copied out before they are overwritten; on CUDA the copies run on a side stream
and the forward waits for them (``before_forward``). Every move into or out of a lower tier is
told to the page table (``record``: ``BlockAllocator.record_tiers``); hashes it refuses (the
tenant's lower-tier cap) are dropped each step (``apply_refusals``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

import torch

from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.engine.swap_cost import SwapCost, should_swap
from kvfleet.compute_service.kv.block_usage import CommittedBlock
from kvfleet.compute_service.kv.disk_pool import DiskPool
from kvfleet.compute_service.kv.host_pool import HostPool
from kvfleet.compute_service.kv.tier_index import POOL, TierCounts, TierIndex, TierPlan
from kvfleet.core.allocator import TIER_DISK, TIER_HOST, TierChange

log = logging.getLogger(__name__)

Record = Callable[[list[TierChange]], None]


class KVTierStore:
    def __init__(self, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_size: int,
                 host_blocks: int, record: Record, disk_dir: str | None = None, disk_blocks: int = 0,
                 preemption_mode: str = "auto", cost: SwapCost | None = None) -> None:
        self.host = HostPool(kv_cache, kv_scales, host_blocks)
        self.disk = DiskPool(disk_dir, self.host.block_bytes) if disk_dir is not None and disk_blocks else None
        self.index = TierIndex(host_blocks, disk_blocks if self.disk is not None else 0)
        self.block_size = block_size
        self.record = record
        self.preemption_mode = preemption_mode
        self.cost = cost
        self.num_swapped_out = self.num_swapped_in = 0
        self._swapped: dict[str, int] = {}  # seq id -> num_computed when swapped out
        self._device = kv_cache.device
        self._stream = torch.cuda.Stream(kv_cache.device) if kv_cache.is_cuda else None
        self._event: torch.cuda.Event | None = None

    # -- hashed blocks ----------------------------------------------------------------------------

    def demote(self, blocks: list[CommittedBlock]) -> None:
        """Keep these committed blocks (about to be rewritten in the pool) in the lower tiers."""
        plan = TierPlan()
        for block in blocks:
            plan.extend(self.index.demote(block.block_hash, block.tenant, block.block_id, block))
        self._perform(plan)

    def promote(self, block_hashes: list[bytes], block_ids: list[int]) -> list[str]:
        """Copy the leading run of ``block_hashes`` held in lower tiers into pool blocks ``block_ids``;
        the tiers they came from, one per block promoted (a disk block found corrupted ends the run:
        it is dropped and recomputed)."""
        run = self.index.run(block_hashes)
        tiers: list[str] = []
        host_slots: list[int] = []
        changes: list[TierChange] = []
        with self._side():
            for (tier, slot), block_hash, block in zip(run, block_hashes, block_ids):
                if tier == TIER_DISK:
                    data = self.disk.read(slot)
                    if data is None:
                        log.warning("KV disk tier: block file %s is missing or corrupted; dropped, recomputing",
                                    self.disk.path(slot).name)
                        changes.append(self.index.take(block_hash))
                        break
                    self.host.block_to_pool(*self.host.block_from_bytes(data), block)
                else:
                    host_slots.append(slot)
                tiers.append(tier)
            held = [b for (tier, _), b in zip(run, block_ids[:len(tiers)]) if tier == TIER_HOST]
            if host_slots:
                self.host.to_pool(host_slots, held)
        changes += [self.index.take(h) for h in block_hashes[:len(tiers)]]
        self.record(changes)
        return tiers

    def apply_refusals(self, block_hashes: list[bytes]) -> None:
        """The page table refused to hold these in a lower tier for their tenant: drop our copies."""
        if block_hashes:
            self.index.refused(block_hashes)

    def entries(self) -> list[TierChange]:
        """Everything held in lower tiers (``BlockAllocator.set_tier_source``)."""
        return self.index.entries()

    def counts(self) -> TierCounts:
        return self.index.counts()

    # -- swapped sequences ------------------------------------------------------------------------

    def swap_out(self, seq: Sequence) -> bool:
        """Copy a preemption victim's computed blocks to host (keyed by its id) when the cost model
        says swapping beats recomputing and host has room; whether it did."""
        if seq.num_dropped_blocks or seq.seq_id in self._swapped:
            return False
        n = -(-seq.num_computed // self.block_size)
        room = n <= self.index.host_blocks - self.index.swapped_blocks()
        if not should_swap(self.preemption_mode, self.cost, n * self.host.block_bytes, seq.num_computed, room):
            return False
        reserved = self.index.reserve_swap(seq.seq_id, n)
        if reserved is None:
            return False
        slots, plan = reserved
        self._perform(plan)
        with self._side():
            self.host.from_pool(seq.block_table[:n], slots)
        self._swapped[seq.seq_id] = seq.num_computed
        self.num_swapped_out += 1
        return True

    def is_swapped(self, seq_id: str) -> bool:
        return seq_id in self._swapped

    def swap_in(self, seq: Sequence, cached_blocks: int) -> int:
        """Copy a swapped sequence's blocks back into its fresh table past its ``cached_blocks`` hot
        prefix; the ``num_computed`` it resumes from."""
        num_computed = self._swapped.pop(seq.seq_id)
        slots = self.index.swap_slots(seq.seq_id) or []
        if cached_blocks < len(slots):
            with self._side():
                self.host.to_pool(slots[cached_blocks:], seq.block_table[cached_blocks:len(slots)])
        self.index.release_swap(seq.seq_id)
        self.num_swapped_in += 1
        return max(num_computed, cached_blocks * self.block_size)

    def forget(self, seq_id: str) -> None:
        """A swapped sequence finished (aborted) before it came back: free its host slots."""
        if self._swapped.pop(seq_id, None) is not None:
            self.index.release_swap(seq_id)

    # -- copies -----------------------------------------------------------------------------------

    def before_forward(self) -> None:
        """The forward's stream waits for the copies issued this step (CUDA; nothing on CPU)."""
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
            self._event = None

    def measure(self, num_blocks: int) -> tuple[float, float]:
        """Bytes per second pool -> host and host -> pool, over ``num_blocks`` blocks and as many
        host slots (run at start, before the tiers hold anything)."""
        n = max(1, min(num_blocks, self.index.host_blocks, self.host.pool.shape[2]))
        blocks = slots = list(range(n))
        rates = []
        for copy in (lambda: self.host.from_pool(blocks, slots), lambda: self.host.to_pool(slots, blocks)):
            seconds = []
            for _ in range(2):  # the first pass warms up
                start = time.perf_counter()
                with self._side():  # where the tiers' copies run
                    copy()
                self._sync()
                seconds.append(time.perf_counter() - start)
            rates.append(n * self.host.block_bytes / max(seconds[-1], 1e-9))
        self.before_forward()
        return rates[0], rates[1]

    def _perform(self, plan: TierPlan) -> None:
        """Run a plan's copies in order (consecutive pool -> host copies as one), then record it."""
        moves = plan.moves
        i = 0
        with self._side():
            while i < len(moves):
                move = moves[i]
                if move.src_tier == POOL:
                    j = i
                    while j < len(moves) and moves[j].src_tier == POOL:
                        j += 1
                    self.host.from_pool([m.src for m in moves[i:j]], [m.dst for m in moves[i:j]])
                    i = j
                    continue
                assert move.src_tier == TIER_HOST and move.dst_tier == TIER_DISK, move
                self._sync()  # the host slot's bytes must have landed before the CPU reads them
                if not self._to_disk(move.src, move.dst):
                    plan.changes.extend(self.index.disable_disk())
                i += 1
        self.record(plan.changes)

    def _to_disk(self, host_slot: int, disk_slot: int) -> bool:
        if self.disk is None or not self.index.disk_blocks:
            return False
        try:
            self.disk.write(disk_slot, self.host.bytes_of(host_slot))
            return True
        except OSError as e:
            log.warning("KV disk tier disabled: cannot write %s (%s); its blocks are dropped",
                        self.disk.path(disk_slot), e.strerror or e)
            return False

    @contextlib.contextmanager
    def _side(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            yield
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def _sync(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
