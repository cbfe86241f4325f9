"""A model's shape as capacity planning needs it: what its KV cache holds per token and how many
parameters it stores and reads. Pure: no torch, no file access (``kvfleet.cli.planning.model_dir`` reads the files).

Two attention families, two KV formulas:

    GQA (Llama, Qwen2, Mistral):  bytes/token = 2 (K, V) x layers x kv_heads x head_dim x bytes
    MLA (DeepSeek-V2/V3):         bytes/token = layers x (kv_lora_rank + qk_rope_head_dim) x bytes
                                  (one compressed latent plus the shared RoPE key; no factor 2)

The built-in presets are the published ``config.json`` of each model on the Hugging Face hub.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MLAShape:
    """Multi-head latent attention (DeepSeek-V2/V3): the cache holds the latent, not K and V."""
    q_lora_rank: int          # 0: queries are projected directly (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True, slots=True)
class MoEShape:
    """Routed experts. The first ``first_k_dense`` layers keep a dense MLP of ``intermediate_size``."""
    num_experts: int
    num_shared_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    first_k_dense: int


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # Qwen2: q, k, v projections carry a bias
    weight_bytes: float = 2.0             # bytes per stored parameter (bf16 2, fp8 1, fp32 4)
    dtype: str = "bfloat16"               # what --kv-cache-dtype auto means
    mla: MLAShape | None = None
    moe: MoEShape | None = None

    def __post_init__(self) -> None:
        sizes = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                 "vocab_size", "max_position_embeddings")
        bad = [f"{size} {getattr(self, size)}" for size in sizes if getattr(self, size) <= 0]
        if bad:
            raise ValueError(f"{self.name}: sizes must be positive, got {', '.join(bad)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_heads} heads is not a multiple of {self.num_kv_heads} KV heads")

    # -- KV cache ---------------------------------------------------------------------------------

    def kv_elements_per_token(self, tensor_parallel: int = 1) -> int:
        """KV elements one token adds on one device. GQA splits the KV heads across the tensor-
        parallel group (a head is never split: with more ranks than heads each rank keeps one
        replica); MLA's latent is shared by all heads, so every rank holds all of it."""
        if self.mla is not None:
            return self.num_layers * (self.mla.kv_lora_rank + self.mla.qk_rope_head_dim)
        return 2 * self.num_layers * self.kv_heads_per_device(tensor_parallel) * self.head_dim

    def kv_heads_per_device(self, tensor_parallel: int) -> int:
        return max(1, -(-self.num_kv_heads // tensor_parallel))

    def kv_formula(self, kv_bytes: float, tensor_parallel: int = 1) -> str:
        """The per-token formula with this model's numbers, for people to check."""
        total = self.kv_elements_per_token(tensor_parallel) * kv_bytes
        if self.mla is not None:
            m = self.mla
            return (f"{self.num_layers} layers x ({m.kv_lora_rank} kv_lora_rank + {m.qk_rope_head_dim} rope_dim)"
                    f" x {kv_bytes:g} B = {total:,.0f} B")
        heads = self.kv_heads_per_device(tensor_parallel)
        per = f" ({self.num_kv_heads}/{tensor_parallel} per device)" if tensor_parallel > 1 else ""
        return (f"2 x {self.num_layers} layers x {heads} kv_heads{per} x {self.head_dim} head_dim"
                f" x {kv_bytes:g} B = {total:,.0f} B")

    # -- parameters -------------------------------------------------------------------------------

    def attention_params(self) -> int:
        h = self.hidden_size
        if self.mla is not None:
            m = self.mla
            qk = self.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
            q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * qk if m.q_lora_rank else h * qk
            kv = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
            kv += m.kv_lora_rank * self.num_heads * (m.qk_nope_head_dim + m.v_head_dim)
            return q + kv + self.num_heads * m.v_head_dim * h
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = q + 2 * kv if self.attention_bias else 0
        return h * q + 2 * h * kv + q * h + bias

    def mlp_params(self, layer: int, active_only: bool = False) -> int:
        """gate, up and down projections (SwiGLU); MoE layers: the experts (all, or those a token
        activates), the shared experts and the router."""
        h = self.hidden_size
        moe = self.moe
        if moe is None or layer < moe.first_k_dense:
            return 3 * h * self.intermediate_size
        experts = moe.experts_per_token if active_only else moe.num_experts
        return 3 * h * moe.expert_intermediate_size * (experts + moe.num_shared_experts) + h * moe.num_experts

    def num_params(self, active_only: bool = False) -> int:
        """Embeddings + per layer (attention, MLP, two RMSNorms) + final norm + lm_head unless tied.
        ``active_only``: what one token reads (MoE: its routed experts only)."""
        embed = self.vocab_size * self.hidden_size
        layers = sum(self.attention_params() + self.mlp_params(i, active_only) + 2 * self.hidden_size
                     for i in range(self.num_layers))
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + layers + self.hidden_size + lm_head

    def weights_bytes(self) -> int:
        return int(self.num_params() * self.weight_bytes)

    def decode_weight_bytes(self, batch: int) -> int:
        """Weight bytes one decode step reads for ``batch`` sequences. Dense: all of them, shared by
        the batch. MoE (the simplification): every non-expert weight, plus the experts the batch
        is expected to touch if routing were uniform: ``E x (1 - (1 - k/E)^batch)`` per layer."""
        if self.moe is None:
            return self.weights_bytes()
        moe = self.moe
        touched = moe.num_experts * (1 - (1 - moe.experts_per_token / moe.num_experts) ** max(1, batch))
        per_expert = 3 * self.hidden_size * moe.expert_intermediate_size
        moe_layers = self.num_layers - moe.first_k_dense
        unread = moe_layers * per_expert * (moe.num_experts - touched)
        return int((self.num_params() - unread) * self.weight_bytes)

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs for one token at ``context`` tokens of history: 2 per active weight, plus
        attention's QK^T and PV (2 x 2 x layers x heads x head_dim x context)."""
        if self.mla is not None:
            m = self.mla
            attn_dim = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2
        else:
            attn_dim = self.head_dim
        return 2.0 * self.num_params(active_only=True) + 4.0 * self.num_layers * self.num_heads * attn_dim * context


# The published config.json of each model (huggingface.co/<repo>/blob/main/config.json).
PRESETS: dict[str, ModelShape] = {
    # meta-llama/Llama-3.1-8B: 32 layers, 4096 hidden, 32 heads / 8 KV heads of 128, 14336 MLP,
    # vocab 128256, 131072 positions, bfloat16, untied (8.03B parameters)
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256, 131072),
    # meta-llama/Llama-3.1-70B: 80 layers, 8192 hidden, 64 heads / 8 KV heads, 28672 MLP (70.6B)
    "llama-3.1-70b": ModelShape("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, 128256, 131072),
    # Qwen/Qwen2.5-7B-Instruct: 28 layers, 3584 hidden, 28 heads / 4 KV heads of 128, 18944 MLP,
    # vocab 152064, 32768 positions (131072 only with the YaRN rope_scaling the config leaves off),
    # q/k/v bias, untied (7.62B)
    "qwen2.5-7b": ModelShape("Qwen2.5-7B", 28, 3584, 18944, 28, 4, 128, 152064, 32768, attention_bias=True),
    # Qwen/Qwen2.5-72B-Instruct: 80 layers, 8192 hidden, 64 heads / 8 KV heads, 29568 MLP (72.7B)
    "qwen2.5-72b": ModelShape("Qwen2.5-72B", 80, 8192, 29568, 64, 8, 128, 152064, 32768, attention_bias=True),
    # mistralai/Mistral-7B-v0.3: 32 layers, 4096 hidden, 32 heads / 8 KV heads of 128, 14336 MLP,
    # vocab 32768, 32768 positions, no sliding window (7.25B)
    "mistral-7b": ModelShape("Mistral-7B-v0.3", 32, 4096, 14336, 32, 8, 128, 32768, 32768),
    # deepseek-ai/DeepSeek-V3: 61 layers, 7168 hidden, 128 heads; MLA with q_lora_rank 1536,
    # kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128; MoE with 256
    # routed experts (8 per token) + 1 shared, of 2048, the first 3 layers dense (18432 MLP);
    # vocab 129280, 163840 positions; weights stored in FP8 (e4m3, 128x128 block scales, not
    # counted), KV in bfloat16. 671B parameters (the 14B multi-token-prediction layer is not
    # loaded for serving and not counted), 37B active.
    "deepseek-v3": ModelShape(
        "DeepSeek-V3", 61, 7168, 18432, 128, 128, 128, 129280, 163840, weight_bytes=1.0,
        mla=MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEShape(num_experts=256, num_shared_experts=1, experts_per_token=8, expert_intermediate_size=2048,
                     first_k_dense=3)),
}
