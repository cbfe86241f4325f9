"""What a paged-attention call reads besides its query, as three objects checked once where they are
built, so that no kernel checks them again:

- ``LayerCache``: one layer's K/V pages (and an FP8 cache's row scales), laid out below;
- ``AttentionMetadata``: the step's batch (which slot each new token is written to, which blocks and
  how many tokens each sequence reads), built by the engine once per step for every layer;
- ``AttentionParams``: one layer's constants (softmax scale, sliding window, logit soft-cap).

KV pool layout of one layer (the engine slices it out of ``kv_cache[layer, 0|1]``)::

    k, v: [num_blocks, num_kv_heads, block_size, head_dim]
           └─ block_id ─┘└─ kv head ─┘└─ offset ─┘
    slot = block_id * block_size + offset

A sequence's token at position ``p`` lives in block ``block_table[p // block_size]`` at offset
``p % block_size``. FP8 caches (``float8_e4m3fn``) hold ``x / scale``, one float32 scale per token and
KV head in scale caches laid out like the cache minus ``head_dim`` (``k_scale, v_scale: [num_blocks,
num_kv_heads, block_size]``); other dtypes have none.

A step packs prefill tokens first, then one token per decoding sequence::

    tokens:  [ seq A chunk (q_len 5) | seq B chunk (q_len 3) | C | D | E ]   <- decode, one each
             \\______ num_prefill_tokens ________/

Only shapes, dtypes, devices and layouts are checked: values (a context shorter than its chunk, a
block id past the pool) would cost a device sync per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPES = (getattr(torch, "float8_e4m3fn", None),)
SCALE_DTYPE = torch.float32  # the scale caches' dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def _require(ok: bool, what: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{what}: {message}")


@dataclass(frozen=True, slots=True)
class AttentionParams:
    """One layer's attention constants; the model builds one per layer, once."""

    scale: float  # softmax scale on q·k, usually head_dim ** -0.5
    window: int | None = None  # sliding window in tokens: the query at p sees keys p - window < k <= p; None: all
    logit_softcap: float | None = None  # scores become cap * tanh(score / cap) before masking; None: off

    def __post_init__(self) -> None:
        _require(self.scale > 0, "AttentionParams", f"scale must be positive, got {self.scale}")
        _require(self.window is None or self.window > 0, "AttentionParams",
                 f"window must be positive or None, got {self.window}")
        _require(self.logit_softcap is None or self.logit_softcap > 0, "AttentionParams",
                 f"logit_softcap must be positive or None, got {self.logit_softcap}")


@dataclass(slots=True)
class LayerCache:
    """One layer's paged K/V: views of the node's pool, so building one copies nothing."""

    k: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim], rows (head_dim) contiguous
    v: torch.Tensor  # k's shape, dtype, strides and device
    k_scale: torch.Tensor | None = None  # FP8 only: [num_blocks, num_kv_heads, block_size] float32, contiguous
    v_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        k, v = self.k, self.v
        what = "LayerCache"
        _require(k.dim() == 4, what, f"k must be [num_blocks, num_kv_heads, block_size, head_dim], got {tuple(k.shape)}")
        _require(v.shape == k.shape and v.stride() == k.stride(), what,
                 f"k and v differ: shapes {tuple(k.shape)} / {tuple(v.shape)}, strides {k.stride()} / {v.stride()}")
        _require(v.dtype == k.dtype and v.device == k.device, what, "k and v must share dtype and device")
        _require(k.stride(3) == 1, what, "rows (head_dim) must be contiguous")
        _require(k.shape[2] % 16 == 0, what, f"block_size {k.shape[2]} is not a multiple of 16")
        if not is_fp8(k.dtype):
            _require(self.k_scale is None and self.v_scale is None, what, "scales belong to FP8 caches only")
            return
        _require(self.k_scale is not None and self.v_scale is not None, what,
                 "an FP8 cache needs its k_scale and v_scale caches")
        for s in (self.k_scale, self.v_scale):
            _require(s.shape == k.shape[:3] and s.dtype == SCALE_DTYPE and s.is_contiguous() and s.device == k.device,
                     what, f"a contiguous float32 scale per (block, KV head, offset) {tuple(k.shape[:3])} "
                     f"expected, got {tuple(s.shape)} {s.dtype}")

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]


def layer_caches(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> list[LayerCache]:
    """A pool's layers as ``LayerCache`` views, checked once when the pool is made, not per step:
    ``kv_cache`` ``[layers, 2, num_blocks, kv_heads, block_size, head_dim]``, FP8 scales
    ``[layers, 2, num_blocks, kv_heads, block_size]``."""
    if kv_scales is None:
        return [LayerCache(layer[0], layer[1]) for layer in kv_cache]
    return [LayerCache(layer[0], layer[1], scales[0], scales[1]) for layer, scales in zip(kv_cache, kv_scales)]


@dataclass(slots=True)
class AttentionMetadata:
    """Where each packed token of a step is written and what each sequence reads; ``P`` prefilling
    sequences, then ``B`` decoding ones (one token each). Every tensor is contiguous, on one device."""

    slot_mapping: torch.Tensor             # [P tokens + B] int64: slot of each new token; negative: padding
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor     # [P, max_blocks] int32; entries past a context are never read
    prefill_context_lens: torch.Tensor     # [P] int32: tokens in cache after this step, the chunk's included
    prefill_query_start_loc: torch.Tensor  # [P + 1] int32: sequence b's chunk is tokens [loc[b], loc[b+1])
    decode_block_tables: torch.Tensor      # [B, max_blocks] int32
    decode_context_lens: torch.Tensor      # [B] int32: tokens in cache, the new one included

    def __post_init__(self) -> None:
        what = "AttentionMetadata"
        tables = {"prefill_block_tables": self.prefill_block_tables, "decode_block_tables": self.decode_block_tables}
        rows = {"prefill_context_lens": self.prefill_context_lens, "decode_context_lens": self.decode_context_lens,
                "prefill_query_start_loc": self.prefill_query_start_loc, "slot_mapping": self.slot_mapping}
        device = self.slot_mapping.device
        for name, t in {**tables, **rows}.items():
            _require(t.dim() == (2 if name in tables else 1), what, f"{name} has shape {tuple(t.shape)}")
            _require(t.dtype == (torch.int64 if name == "slot_mapping" else torch.int32), what,
                     f"{name} must be {'int64' if name == 'slot_mapping' else 'int32'}, got {t.dtype}")
            _require(t.device == device, what, f"{name} is on {t.device}, slot_mapping on {device}")
            _require(t.is_contiguous(), what, f"{name} must be contiguous")
        num_prefills, num_decodes = self.num_prefills, self.num_decodes
        _require(self.prefill_block_tables.shape[0] == num_prefills, what,
                 f"{self.prefill_block_tables.shape[0]} prefill block tables for {num_prefills} prefill context_lens")
        _require(self.prefill_query_start_loc.shape[0] == num_prefills + 1, what,
                 f"prefill_query_start_loc has {self.prefill_query_start_loc.shape[0]} entries, "
                 f"expected {num_prefills + 1}")
        _require(self.decode_block_tables.shape[0] == num_decodes, what,
                 f"{self.decode_block_tables.shape[0]} decode block tables for {num_decodes} decode context_lens")
        _require(self.slot_mapping.shape[0] == self.num_prefill_tokens + num_decodes, what,
                 f"{self.slot_mapping.shape[0]} slots for {self.num_prefill_tokens} prefill tokens "
                 f"and {num_decodes} decode tokens")

    @property
    def num_prefills(self) -> int:
        return self.prefill_context_lens.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.decode_context_lens.shape[0]

    @classmethod
    def prefill_only(cls, block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
        """A step of prefill chunks only (tests, benchmarks). ``slot_mapping`` None: the chunks' K/V
        are already in the cache (every slot is padding)."""
        num_tokens = int(query_start_loc[-1])
        return cls(_slots(slot_mapping, num_tokens, context_lens.device), num_tokens, block_tables, context_lens,
                   query_start_loc, *_empty_part(context_lens.device))

    @classmethod
    def decode_only(cls, block_tables: torch.Tensor, context_lens: torch.Tensor,
                    slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
        """A step of decoding sequences only (tests, benchmarks); ``slot_mapping`` as in ``prefill_only``."""
        device = context_lens.device
        tables, lens = _empty_part(device)
        return cls(_slots(slot_mapping, context_lens.shape[0], device), 0, tables, lens,
                   torch.zeros(1, dtype=torch.int32, device=device), block_tables, context_lens)


def _empty_part(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables and context lengths of no sequence."""
    return torch.zeros(0, 0, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int32, device=device)


def _slots(slot_mapping: torch.Tensor | None, num_tokens: int, device: torch.device) -> torch.Tensor:
    if slot_mapping is not None:
        return slot_mapping
    return torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
