"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as one small model over a paged KV pool.

Tokens of all sequences in a step are packed into one ``[T]`` batch; attention reads and writes
the pool through ``kernels`` (``store_kv``, ``paged_prefill``, ``paged_decode``). q/k/v and
gate/up projections are fused into single matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from compute_service.model.config import ModelConfig
from compute_service.model.rope import RotaryEmbedding, apply_rope
from kernels.metadata import AttentionMetadata, AttentionParams, LayerCache


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    params: AttentionParams  # scale, sliding window (tokens; None: full), logit soft-cap; set per layer by CausalLM

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=config.o_proj_bias)
        # Qwen3: RMSNorm over each head's q and k, before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                meta: AttentionMetadata, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, hidden]; kv_cache: [2, num_blocks, kv_heads, block_size, head_dim]
        # kv_scales (FP8 caches only): [2, num_blocks, kv_heads, block_size]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, *rope)
        cache = LayerCache(kv_cache[0], kv_cache[1], *(() if kv_scales is None else (kv_scales[0], kv_scales[1])))
        kernels.store_kv(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        p = meta.num_prefill_tokens
        if p:
            out[:p] = kernels.paged_prefill(q[:p], cache, meta, self.params)
        if p < num_tokens:
            out[p:] = kernels.paged_decode(q[p:], cache, meta, self.params)
        return self.o_proj(out.view(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, meta, kv_scales=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, kv_scales)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        for layer, window in zip(self.layers, config.layer_windows):
            layer.self_attn.params = AttentionParams(config.head_dim ** -0.5, window)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(config.head_dim, config.max_context_len, config.rope,
                                    config.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor,
                kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[len(logits_indices), vocab]`` (float32) for the packed tokens picked by
        ``logits_indices``; every token's K/V is written to ``kv_cache`` ``[layers, 2, ...]`` (an FP8
        cache with its per-row scales in ``kv_scales`` ``[layers, 2, num_blocks, kv_heads, block_size]``)."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, x.dtype, meta)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_cache[i], meta, None if kv_scales is None else kv_scales[i])
        x = self.norm(x[logits_indices])
        return self.lm_head(x).float()
