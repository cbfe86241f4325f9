"""Rotary position embeddings with the config's theta and Llama-3 style frequency scaling.

The tables are computed exactly as Hugging Face computes them (float32 ``positions * inv_freq``,
``cat(freqs, freqs)``), so greedy tokens match ``transformers`` bit for bit where the math allows.
"""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "llama3":
        inv_freq = _llama3_scaled(inv_freq, rope_scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Long wavelengths slowed by ``factor``, short ones kept, the band between interpolated."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original_len / low, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= original_len / high) & (wavelen <= original_len / low)
    return torch.where(in_band, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables ``[max_positions, head_dim]``."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, rope_scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim]`` for the packed tokens' positions (once per forward)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, H, D], k: [T, KV, D], cos/sin: [T, 1, D]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
