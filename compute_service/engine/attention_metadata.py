"""Where each packed token of a step reads and writes the paged KV pool.

A step packs prefill tokens first, then one token per decoding sequence:

    tokens:  [ seq A chunk (q_len 5) | seq B chunk (q_len 3) | C | D | E ]   <- decode, one each
             \\______ num_prefill_tokens ________/
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor             # [T] int64: block_id * block_size + offset of each token
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor     # [P, max_blocks] int32
    prefill_context_lens: torch.Tensor     # [P] int32: tokens in cache after this step
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32: offsets of each sequence's chunk
    decode_block_tables: torch.Tensor      # [B, max_blocks] int32
    decode_context_lens: torch.Tensor      # [B] int32
    scale: float

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.decode_context_lens.shape[0]
