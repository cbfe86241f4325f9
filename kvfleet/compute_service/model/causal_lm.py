"""Every served architecture (``architectures.ARCHITECTURES``: Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2) as one small decoder over a paged KV pool; what differs comes from ``config.architecture``.

Tokens of all sequences in a step are packed into one ``[T]`` batch; attention reads and writes
the pool through ``kernels`` (``store_kv``, ``paged_prefill``, ``paged_decode``). q/k/v and
gate/up projections are fused into single matmuls whether or not the checkpoint fuses them.

On CPU, a Llama-style model (no norms after the blocks, no q/k norms, the whole head turned, a 16- or
32-bit cache) takes the fused path: each layer is residual add + RMSNorm, the qkv matmul, RoPE + KV
store, attention, the o matmul, residual add + RMSNorm, the MLP — the native ops of
``kvfleet/kernels/csrc/fused_cpu.cpp`` in place of a dozen small torch ops per layer, which on a model of
30 thin layers (SmolLM2-135M) cost as much per step as the arithmetic around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet import kernels
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.compute_service.model.cpu_linear import rows_per_pass, whole_sizes
from kvfleet.compute_service.model.rope import RotaryEmbedding, apply_rope
from kvfleet.kernels import cpu_kernels
from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}


class RMSNorm(nn.Module):
    """``offset`` 0: ``weight * norm(x)`` in x's dtype (Llama). ``offset`` 1: Gemma stores the weight
    less one and scales in float32, ``norm(x) * (1 + weight)``, cast back last (each as transformers)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.full((size,), 1.0 - offset))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    return x if cap is None else torch.tanh(x / cap) * cap


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, window: int | None):
        super().__init__()
        # the layer's scale, sliding window (tokens; None: full) and logit soft-cap (None: none), checked once
        self.params = AttentionParams(config.attention_scale, window, config.attn_logit_softcap)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: RMSNorm over each head's q and k, before RoPE
        offset = config.architecture.norm_weight_offset
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, offset) if config.qk_norm else None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden]; cache: this layer's pages (and FP8 scales), views of the pool
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, *rope)
        kernels.store_kv(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        p = meta.num_prefill_tokens
        if p:
            out[:p] = kernels.paged_prefill(q[:p], cache, meta, self.params)
        if p < num_tokens:
            out[p:] = kernels.paged_decode(q[p:], cache, meta, self.params)
        return self.o_proj(out.view(num_tokens, -1))

    def forward_fused(self, x, rope: tuple[torch.Tensor, torch.Tensor], cache: LayerCache,
                      meta: AttentionMetadata) -> torch.Tensor:
        """``forward`` with RoPE and the KV store in one native call (cos/sin ``[T, head_dim]``)."""
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        cpu_kernels.rope_store(q, k.view(num_tokens, self.num_kv_heads, self.head_dim),
                               v.view(num_tokens, self.num_kv_heads, self.head_dim), *rope, cache, meta.slot_mapping)
        p = meta.num_prefill_tokens
        if p == 0:
            out = kernels.paged_decode(q, cache, meta, self.params)
        elif p == num_tokens:
            out = kernels.paged_prefill(q, cache, meta, self.params)
        else:
            out = torch.empty(q.shape, dtype=q.dtype)
            out[:p] = kernels.paged_prefill(q[:p], cache, meta, self.params)
            out[p:] = kernels.paged_decode(q[p:], cache, meta, self.params)
        return self.o_proj(out.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """On CPU in passes of rows whose gate-up output stays under glibc's mmap ceiling (cpu_linear.py)."""
        flat = x.reshape(-1, x.shape[-1])
        rows = rows_per_pass(2 * self.intermediate * x.element_size(), getattr(self.gate_up_proj, "whole_rows", ()))
        if flat.shape[0] <= rows or x.device.type != "cpu":
            return self._pass(x)
        out = flat.new_empty(flat.shape[0], self.down_proj.out_features)
        for start in range(0, flat.shape[0], rows):
            out[start:start + rows] = self._pass(flat[start:start + rows])
        return out.view(*x.shape[:-1], -1)

    def pass_rows(self, batch_hint: int, element_size: int) -> int:
        """The rows of a pass when a step fills its budget (pack_linears makes it a whole shape)."""
        return rows_per_pass(2 * self.intermediate * element_size, whole_sizes(batch_hint))

    def _pass(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate).mul_(up))


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks; Gemma 2 also norms each block's output (``LayerNorms.attn_out`` /
    ``mlp_out``). The norms carry the checkpoint's names, so loading maps them one to one."""

    def __init__(self, config: ModelConfig, window: int | None):
        super().__init__()
        names = config.architecture.norms
        for name in names.names():
            self.add_module(name, RMSNorm(config.hidden_size, config.rms_norm_eps,
                                          config.architecture.norm_weight_offset))
        # by place, not registered twice (a plain tuple): before/after attention, before/after the MLP
        self.places = tuple(None if n is None else getattr(self, n)
                            for n in (names.attn_in, names.attn_out, names.mlp_in, names.mlp_out))
        self.self_attn = Attention(config, window)
        self.mlp = MLP(config)

    def forward(self, x, rope, cache, meta):
        attn_in, attn_out, mlp_in, mlp_out = self.places
        h = self.self_attn(attn_in(x), rope, cache, meta)
        x = x + (h if attn_out is None else attn_out(h))
        h = self.mlp(mlp_in(x))
        return x + (h if mlp_out is None else mlp_out(h))

    def forward_fused(self, x, h, rope, cache, meta) -> torch.Tensor:
        """The fused path (``CausalLM.fusable``): ``x += h`` in place (the previous layer's output; None
        at the first layer), and this layer's output, still to be added to ``x``."""
        attn_in, _, mlp_in, _ = self.places
        h = self.self_attn.forward_fused(cpu_kernels.add_rms_norm(x, h, attn_in.weight, attn_in.eps), rope, cache, meta)
        return self.mlp(cpu_kernels.add_rms_norm(x, h, mlp_in.weight, mlp_in.eps))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Gemma: embeddings times sqrt(hidden), the factor rounded to the weights' dtype first
        self.embed_scale = config.hidden_size ** 0.5 if config.architecture.scale_embeddings else None
        self.layers = nn.ModuleList(DecoderLayer(config, window) for window in config.layer_windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.architecture.norm_weight_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = rotary_embedding(config)
        arch = config.architecture
        self.fusable = (arch.norms.attn_out is None and arch.norms.mlp_out is None and not arch.norm_weight_offset
                        and not config.qk_norm and config.rotary_dim == config.head_dim and self.embed_scale is None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: Sequence[LayerCache],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (float32) for the packed tokens picked by
        ``logits_indices``; every token's K/V is written to its layer's pages in ``caches``
        (``kvfleet.kernels.metadata.layer_caches`` of the pool, made once)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * torch.tensor(self.embed_scale, dtype=torch.float32, device=x.device).to(x.dtype)
        rope = self.rope.tables(positions, x.dtype, meta)
        if self.fusable and caches[0].k.dtype == caches[0].v.dtype == x.dtype and cpu_kernels.supports_fused(x):
            cos, sin = (t.view(t.shape[0], -1) for t in rope)
            h = None
            for layer, cache in zip(self.layers, caches, strict=True):
                h = layer.forward_fused(x, h, (cos, sin), cache, meta)
            x = self.norm(x[logits_indices] + h[logits_indices])
            return soft_cap(self.lm_head(x), self.config.final_logit_softcap).float()
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, rope, cache, meta)
        x = self.norm(x[logits_indices])
        return soft_cap(self.lm_head(x), self.config.final_logit_softcap).float()


def rotary_embedding(config: ModelConfig) -> RotaryEmbedding:
    """The float32 cos/sin tables over the rotated share of each head."""
    return RotaryEmbedding(config.rotary_dim, config.max_context_len, config.rope, config.max_position_embeddings)
