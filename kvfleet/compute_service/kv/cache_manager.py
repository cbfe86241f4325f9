"""Per-sequence use of a node's ``BlockAllocator``: what the scheduler calls to give a sequence its
blocks, grow it, commit its full blocks under their chained hashes, and release it. Pure Python.

The allocator holds the page table (here or in block_service); this class only translates a
sequence's progress into allocator calls, batched per step.

**Sliding windows.** With ``window`` set (every layer of the model attends through a window, the
widest being ``window`` tokens; ``sliding_window.droppable_window``), the blocks of a sequence
wholly outside it are given back as it grows (``drop_front``), so a long sequence holds
O(window / block_size) blocks. The next query is at position ``num_computed`` and sees keys
``> num_computed - window``; later queries see less, so block ``i`` is never read again once
``(i + 1) * block_size <= num_computed - window + 1``. The engine's table keeps those positions
(stale ids, never read by a kernel); a model with a full-attention layer drops nothing.

**Contiguous layout** (``reserve_tokens`` set; ``kv/layout.py``). ``allocate`` asks for
``reserve_tokens`` slots with no prefix hashes (no cache hit), so the table covers every position
the sequence may reach and ``grow`` never asks again; nothing is committed and nothing dropped, so
the reservation is held whole until ``release``.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.kv.block_usage import BlockUsage
from kvfleet.compute_service.kv.tier_index import LowerTiers, PrefixLookups
from kvfleet.core.allocator import DROPPED, BlockAllocator, Refusal
from kvfleet.core.block_hash import (
    cluster_seed,
    next_block_hash,
    reusable_blocks,
    tenant_extra_key,
)


class KVCacheManager:
    def __init__(self, allocator: BlockAllocator, share_prefix_across_tenants: bool = False,
                 window: int | None = None, reserve_tokens: int | None = None, tiers: LowerTiers | None = None):
        self.allocator = allocator
        self.window = window
        self.reserve_tokens = reserve_tokens  # contiguous layout: slots each sequence reserves; None: paged
        self.block_size = allocator.block_size
        self.share_across_tenants = share_prefix_across_tenants
        self.seed = cluster_seed()
        self.usage = BlockUsage()  # what each block holds and how often it was reused (KV snapshots)
        self.tiers = tiers         # host/disk tiers below the pool (kv/tier_store.py); None: evicted is lost
        self.lookups = PrefixLookups()
        # each tenant's prefix group as its last sequence here carried it (the router's decision): the
        # salt its committed blocks are served under to peers (``salt_of``, node/kv_holder.py)
        self.prefix_groups: dict[str, str] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_to_admit(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` takes at admission: its reservation when contiguous."""
        return self.blocks_for(self.reserve_tokens or num_tokens)

    def allocate(self, seq: Sequence) -> Refusal | None:
        """Blocks for all of ``seq``'s current tokens; reuses cached prefix blocks, so on success
        ``seq.num_computed`` starts past them. At least one token is always left to compute (its
        logits are needed), so a fully cached prompt recomputes its last block.

        With lower tiers, the blocks past the hot prefix found in host or on disk are promoted
        (copied into the fresh blocks) instead of recomputed, and a sequence swapped out at its
        preemption gets its blocks back; the commit path then makes them hot again."""
        if self.reserve_tokens is not None:
            return self._reserve(seq)
        self._extend_hashes(seq, seq.num_tokens // self.block_size)
        reusable = reusable_blocks(seq.num_tokens, self.block_size)
        result = self.allocator.allocate(seq.seq_id, seq.tenant, seq.block_hashes[:reusable], seq.num_tokens)
        if isinstance(result, Refusal):
            return result
        seq.block_table = list(result.block_ids)
        cached = result.num_cached_blocks
        self.usage.hit(seq.block_table[:cached], seq.block_hashes[:cached])
        self._hand_fresh(seq.block_table[cached:])
        seq.num_allocated_tokens = seq.num_tokens
        seq.num_committed_blocks = cached
        if self.tiers is not None and self.tiers.is_swapped(seq.seq_id):
            seq.num_computed = self.tiers.swap_in(seq, cached)
            return None
        found = [] if self.tiers is None else self.tiers.promote(seq.block_hashes[cached:reusable],
                                                                  seq.block_table[cached:reusable])
        self.lookups.add(cached, found, reusable, seq.tenant, seq.block_hashes[:cached])
        seq.num_computed = (cached + len(found)) * self.block_size
        return None

    def prefix_in_flight(self, seq: Sequence, prefilling: Iterable[Sequence]) -> bool:
        """Whether blocks ``seq`` would reuse are being written right now by one of ``prefilling``
        (sequences of this step still computing their prompt): the first block such a sequence
        has not committed yet is also one of ``seq``'s reusable leading blocks. Hashes are chained,
        so one equal hash means an equal prefix up to it. Admitted now, ``seq`` would compute
        those blocks again; admitted once they are committed, it finds them cached."""
        if self.reserve_tokens is not None:
            return False  # contiguous: no prefix sharing
        reusable = reusable_blocks(seq.num_tokens, self.block_size)
        if reusable == 0:
            return False
        self._extend_hashes(seq, seq.num_tokens // self.block_size)
        for other in prefilling:
            first = other.num_committed_blocks
            if first < reusable and first < len(other.block_hashes) and other.block_hashes[first] == seq.block_hashes[first]:
                return True
        return False

    def preempt(self, seq: Sequence) -> bool:
        """Give a preemption victim's blocks back; first, when the lower tiers take it (cost and
        room), its KV is swapped out to come back at re-admission. Whether it was swapped."""
        swapped = self.tiers is not None and self.tiers.swap_out(seq)
        self.release([seq])
        return swapped

    def forget(self, seqs: Iterable[Sequence]) -> None:
        """Finished sequences: the swapped-out copies of any that never came back are freed."""
        if self.tiers is not None:
            for seq in seqs:
                self.tiers.forget(seq.seq_id)

    def _hand_fresh(self, block_ids: list[int]) -> None:
        """Blocks the engine is about to write: what they held is demoted to a lower tier first."""
        lost = self.usage.overwritten(block_ids)
        if lost and self.tiers is not None:
            self.tiers.demote(lost)

    def _reserve(self, seq: Sequence) -> Refusal | None:
        """Contiguous: the whole reservation at once, nothing looked up in the prefix cache."""
        assert seq.num_tokens <= self.reserve_tokens, "the engine refuses prompts past max_model_len"
        result = self.allocator.allocate(seq.seq_id, seq.tenant, [], self.reserve_tokens)
        if isinstance(result, Refusal):
            return result
        seq.block_table = list(result.block_ids)
        self._hand_fresh(seq.block_table)  # cached blocks (a restored snapshot's) it took are rewritten
        seq.num_allocated_tokens = self.reserve_tokens
        seq.num_committed_blocks = seq.num_computed = 0
        return None

    def grow(self, plan: list[tuple[Sequence, int]]) -> list[Refusal | None]:
        """Make room for each ``(seq, n)``: ``n`` more tokens from ``seq.num_computed``; one
        allocator call for all of them."""
        # only growth beyond what is reserved is sent (decodes always grow: fill levels stay current)
        todo = [(seq, seq.num_computed + n) for seq, n in plan if seq.num_computed + n > seq.num_allocated_tokens]
        answers = dict(zip((seq.seq_id for seq, _ in todo),
                           self.allocator.extend([(seq.seq_id, total) for seq, total in todo]) if todo else []))
        results: list[Refusal | None] = []
        for seq, n in plan:
            answer = answers.get(seq.seq_id, [])
            if isinstance(answer, Refusal):
                results.append(answer)
                continue
            seq.block_table.extend(answer)
            self._hand_fresh(answer)
            seq.num_allocated_tokens = max(seq.num_allocated_tokens, seq.num_computed + n)
            results.append(None)
        return results

    def commit_full_blocks(self, seqs: Iterable[Sequence]) -> None:
        """Publish every block that became full and written this step (one allocator call)."""
        if self.reserve_tokens is not None:
            return  # contiguous: no prefix sharing
        commits: list[tuple[str, int, bytes]] = []
        for seq in seqs:
            num_full = seq.num_computed // self.block_size
            if num_full <= seq.num_committed_blocks:
                continue
            self._extend_hashes(seq, num_full)
            commits.extend((seq.seq_id, i, seq.block_hashes[i]) for i in range(seq.num_committed_blocks, num_full))
            self._record_commits(seq, range(seq.num_committed_blocks, num_full))
            seq.num_committed_blocks = num_full
        if commits:
            self.allocator.commit(commits)

    def drop_outside_window(self, seqs: Iterable[Sequence]) -> None:
        """Give back the blocks no layer will read again (one allocator call); after the step's
        commits, so committed ones stay cached."""
        if self.window is None or self.reserve_tokens is not None:
            return  # contiguous: the reservation is held whole until the sequence finishes
        drops: list[tuple[str, int]] = []
        for seq in seqs:
            n = min(max(0, seq.num_computed - self.window + 1) // self.block_size, len(seq.block_table))
            if n > seq.num_dropped_blocks:
                drops.append((seq.seq_id, n))
                seq.num_dropped_blocks = n
        if drops:
            self.allocator.drop_front(drops)

    def release(self, seqs: Iterable[Sequence]) -> None:
        seqs = list(seqs)
        ids = [seq.seq_id for seq in seqs]
        if ids:
            self.allocator.release(ids)
        for seq in seqs:
            seq.block_table = []

    def salt_of(self, tenant: str) -> bytes:
        """The extra key ``tenant``'s chains are salted with here: its own name, or its prefix group
        as its sequences on this node carried it."""
        return tenant_extra_key(tenant, self.share_across_tenants, self.prefix_groups.get(tenant, ""))

    def _salt(self, seq: Sequence) -> bytes:
        self.prefix_groups[seq.tenant] = seq.prefix_group
        return tenant_extra_key(seq.tenant, self.share_across_tenants, seq.prefix_group)

    def _record_commits(self, seq: Sequence, indexes: range) -> None:
        bs, extra = self.block_size, self._salt(seq)
        for i in indexes:
            if seq.block_table[i] != DROPPED:
                self.usage.committed(seq.block_table[i], seq.block_hashes[i], seq.block_hashes[i - 1] if i else b"",
                                     seq.token_ids[i * bs:(i + 1) * bs], extra, tenant=seq.tenant)

    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        bs = self.block_size
        extra = self._salt(seq)
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else b""
            seq.block_hashes.append(next_block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs], extra, self.seed))
