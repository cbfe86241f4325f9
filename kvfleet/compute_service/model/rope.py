"""Rotary position embeddings for every RoPE type the engine serves (``rope_config.TYPE_KEYS``).

The tables are computed exactly as transformers 5.24's ``ROPE_INIT_FUNCTIONS`` compute them
(float32 ``positions * inv_freq``, ``cat(freqs, freqs)``, cos/sin times the attention factor), so
greedy tokens match ``transformers`` bit for bit where the math allows.

Dynamic NTK is the one type whose frequencies depend on the sequence: transformers recomputes them
from ``seq_len`` = the longest position of the forward pass + 1 whenever it grows past
``max_position_embeddings``, and each token's key is cached rotated as it was when computed. Here
every token is rotated with its own sequence's length after this step (its context length), which
is the same thing for one sequence generated at a time: the prompt's tokens with the prompt length,
each later token with its own position + 1.
"""

from __future__ import annotations

import math

import torch

from kvfleet.compute_service.model.rope_config import RopeConfig
from kvfleet.kernels.metadata import AttentionMetadata


def _plain(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq ``[head_dim / 2]``, cos/sin scale) for the sequence-independent types (dynamic:
    its frequencies at or below ``max_position_embeddings``, which are the plain ones)."""
    if rope.rope_type == "linear":
        return _plain(head_dim, rope.theta) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_scaled(_plain(head_dim, rope.theta), rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(head_dim, rope), rope.attention_factor
    return _plain(head_dim, rope.theta), 1.0


def _llama3_scaled(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Long wavelengths slowed by ``factor``, short ones kept, the band between interpolated."""
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    original_len = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_band, smoothed, scaled)


def _yarn(dim: int, rope: RopeConfig) -> torch.Tensor:
    """Dimensions rotating fewer than ``beta_slow`` times over the original length are interpolated
    (÷ factor), those rotating more than ``beta_fast`` times kept, a linear ramp between."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def _dynamic_ntk(head_dim: int, rope: RopeConfig, max_position_embeddings: int, seq_len: int) -> torch.Tensor:
    """The NTK-raised base for ``seq_len`` (> max_position_embeddings), in transformers' float32 steps."""
    seq = torch.tensor(seq_len)
    base = rope.theta * ((rope.factor * seq / max_position_embeddings) - (rope.factor - 1)) ** (
        head_dim / (head_dim - 2))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


def token_seq_lens(meta: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """``[T]``: each packed token's sequence length after this step (see the layout in
    kvfleet/kernels/metadata.py: prefill chunks first, then one token per decoding sequence)."""
    q_lens = meta.prefill_query_start_loc.diff().long()
    prefill = torch.repeat_interleave(meta.prefill_context_lens.long(), q_lens)
    out = torch.cat([prefill, meta.decode_context_lens.long()])
    assert out.shape[0] == num_tokens, (out.shape, num_tokens)
    return out


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables ``[max_positions, head_dim]``; dynamic NTK recomputes the rows of
    tokens whose sequence outgrew ``max_position_embeddings``. ``head_dim`` is the rotated width
    (``ModelConfig.rotary_dim``: less than a head under partial rotation, as transformers computes it)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, max_position_embeddings: int):
        super().__init__()
        self.head_dim, self.rope, self.max_position_embeddings = head_dim, rope, max_position_embeddings
        inv_freq, scale = inverse_frequencies(head_dim, rope)
        cos, sin = _cos_sin(torch.arange(max_positions, dtype=torch.int64), inv_freq, scale)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for the packed tokens' positions (once per forward)."""
        cos, sin = self.cos[positions], self.sin[positions]
        if self.rope.rope_type == "dynamic":
            cos, sin = self._dynamic_rows(positions, cos, sin, token_seq_lens(meta, positions.shape[0]))
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    def _dynamic_rows(self, positions, cos, sin, seq_lens):
        long = seq_lens > self.max_position_embeddings
        for seq_len in seq_lens[long].unique().tolist():  # a device sync, for dynamic models only
            rows = seq_lens == seq_len
            inv_freq = _dynamic_ntk(self.head_dim, self.rope, self.max_position_embeddings, seq_len)
            cos[rows], sin[rows] = _cos_sin(positions[rows], inv_freq.to(positions.device), 1.0)
        return cos, sin


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, H, D], k: [T, KV, D], cos/sin: [T, 1, R] with R <= D (partial rotation: the first R turn)
    return _turn(q, cos, sin), _turn(k, cos, sin)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary = cos.shape[-1]
    if rotary == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :rotary], x[..., rotary:]
    return torch.cat([turned * cos + _rotate_half(turned) * sin, kept], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
