"""Turns a scheduled batch into tensors, runs the model over the paged pool, returns the logits of
the sequences that sample this step."""

from __future__ import annotations

import torch

from kvfleet.compute_service.engine.scheduler import ScheduledBatch
from kvfleet.compute_service.engine.sequence import Sequence
from kvfleet.compute_service.model.causal_lm import CausalLM
from kvfleet.kernels.metadata import AttentionMetadata, layer_caches


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, block_size: int, device: torch.device,
                 kv_scales: torch.Tensor | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales  # FP8 pools: one float32 scale per (layer, K/V, block, kv head, offset)
        # per layer, views of the pool (FP8: and its float32 scale per row), checked once here, not per step
        self.caches = layer_caches(kv_cache, kv_scales)
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Logits ``[S, vocab]`` and the ``S`` sequences they belong to (those whose chunk reaches
        their last token)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        query_start = [0]
        prefill_lens: list[int] = []
        chunks = batch.prefills + [(seq, 1) for seq in batch.decodes]
        for seq, n in chunks:
            start = seq.num_computed
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.append(self._slots(seq, start, n))
            if start + n == seq.num_tokens:
                logits_indices.append(len(input_ids) - 1)
                sampled.append(seq)
        for seq, n in batch.prefills:
            query_start.append(query_start[-1] + n)
            prefill_lens.append(seq.num_computed + n)

        dev = self.device
        decode_seqs = batch.decodes
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots).to(dev),
            num_prefill_tokens=query_start[-1],
            prefill_block_tables=_block_tables([s for s, _ in batch.prefills]).to(dev),
            prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=dev),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            decode_block_tables=_block_tables(decode_seqs).to(dev),
            decode_context_lens=torch.tensor([s.num_computed + 1 for s in decode_seqs], dtype=torch.int32, device=dev),
        )
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev), self.caches, meta,
            torch.tensor(logits_indices, dtype=torch.int64, device=dev))
        return logits, sampled

    def _slots(self, seq: Sequence, start: int, n: int) -> torch.Tensor:
        """Slots of positions ``[start, start + n)``: ``block_table[p // bs] * bs + p % bs``."""
        bs = self.block_size
        first, last = start // bs, (start + n - 1) // bs
        blocks = torch.tensor(seq.block_table[first:last + 1], dtype=torch.int64)
        all_slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
        return all_slots[start - first * bs:start - first * bs + n]


def _block_tables(seqs: list[Sequence]) -> torch.Tensor:
    """``[len(seqs), max_blocks]`` int32, rows padded with 0 past each sequence's table."""
    width = max((len(s.block_table) for s in seqs), default=0)
    table = torch.zeros(len(seqs), width, dtype=torch.int32)
    for row, seq in enumerate(seqs):
        table[row, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
    return table
