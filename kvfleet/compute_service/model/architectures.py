"""Every architecture the engine serves, one entry each: what differs between them, and nothing else.

The engine has one decoder (``causal_lm``); an entry says how a model of that type reads into it —
which ``config.json`` fields it reads and their defaults, how its checkpoint names and splits the
projections, where its norms sit, its activation, its embedding and logit scaling, its attention
scale and soft-cap, which layers slide, how much of each head RoPE rotates. The config reader, the
weight loader, the window reader, the planner, the model maker and the tests all read this table, so
adding an architecture is one entry here plus its test row (``tests/models/hf_models.py``).

Values are taken from transformers 5.24's modeling and configuration files. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# A bias switch: a constant, or the name of the config.json field (default false) that turns it on.
Switch = bool | str


@dataclass(frozen=True, slots=True)
class LayerNorms:
    """Checkpoint names of a layer's RMSNorms by where they sit (``None``: the layer has none there).
    The engine's modules carry the same names, so a checkpoint maps onto them one to one."""
    attn_in: str = "input_layernorm"            # before attention
    attn_out: str | None = None                 # on attention's output, before the residual add
    mlp_in: str = "post_attention_layernorm"    # before the MLP (Llama names it after attention)
    mlp_out: str | None = None                  # on the MLP's output, before the residual add

    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.attn_in, self.attn_out, self.mlp_in, self.mlp_out) if n is not None)


@dataclass(frozen=True, slots=True)
class Architecture:
    model_type: str
    hf_class: str                                   # config.json's "architectures" entry
    fields: frozenset[str] = frozenset()            # config fields read beyond the common ones
    ignored: frozenset[str] = frozenset()           # fields transformers' model of this type never reads
    defaults: dict = field(default_factory=dict)    # a field's value when config.json omits it
    # checkpoint
    fused_qkv: bool = False         # one qkv_proj tensor (q, k, v rows in that order) instead of three
    fused_gate_up: bool = False     # one gate_up_proj tensor (gate rows first) instead of two
    qkv_bias: Switch = False
    o_proj_bias: Switch = False
    mlp_bias: Switch = False
    qk_norm: bool = False           # per-head RMSNorm of q and k before RoPE
    norms: LayerNorms = LayerNorms()
    # numerics
    activation_field: str = "hidden_act"
    activations: tuple[str, ...] = ("silu",)        # the gated MLP's activations served; the first is the default
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    scale_embeddings: bool = False   # embeddings x sqrt(hidden_size)
    final_softcap_field: str | None = None   # logits -> cap * tanh(logits / cap)
    attn_softcap_field: str | None = None    # q.k*scale -> cap * tanh(. / cap), before the mask
    attention_scale_field: str | None = None  # scale = field ** -0.5 (else head_dim ** -0.5)
    windows: str = "none"            # the sliding-window rule (``sliding_window.RULES``)
    partial_rotary: bool = False     # RoPE turns the first ``partial_rotary_factor`` of each head
    rope_types: frozenset[str] | None = None        # RoPE types transformers allows here (None: any)
    rope_aliases: dict = field(default_factory=dict)  # a rope type this architecture reads as another

    def switch(self, value: Switch, raw: dict) -> bool:
        return value if isinstance(value, bool) else bool(raw.get(value, False))

    def read_fields(self) -> frozenset[str]:
        """Every field this entry reads beyond the common ones (bias switches and named fields included)."""
        named = (self.qkv_bias, self.o_proj_bias, self.mlp_bias, self.activation_field, self.final_softcap_field,
                 self.attn_softcap_field, self.attention_scale_field)
        return self.fields | {n for n in named if isinstance(n, str)}


_QWEN_WINDOWS = dict(use_sliding_window=False, sliding_window=4096, max_window_layers=28)
_WINDOWED = frozenset({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})

ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("llama", "LlamaForCausalLM", qkv_bias="attention_bias", o_proj_bias="attention_bias",
                 mlp_bias="mlp_bias", ignored=_WINDOWED),
    Architecture("mistral", "MistralForCausalLM", windows="every_layer", ignored=_WINDOWED - {"sliding_window"},
                 defaults=dict(sliding_window=4096)),
    # transformers' Qwen2 always has q/k/v biases (and no o_proj bias) and reads no attention_bias
    Architecture("qwen2", "Qwen2ForCausalLM", qkv_bias=True, windows="qwen", ignored=frozenset({"attention_bias"}),
                 defaults=_QWEN_WINDOWS),
    Architecture("qwen3", "Qwen3ForCausalLM", qkv_bias="attention_bias", o_proj_bias="attention_bias",
                 qk_norm=True, windows="qwen", defaults=_QWEN_WINDOWS),
    Architecture("phi3", "Phi3ForCausalLM", fused_qkv=True, fused_gate_up=True, windows="every_layer",
                 partial_rotary=True, rope_types=frozenset({"default"}),
                 rope_aliases={"su": "longrope", "yarn": "longrope"},
                 fields=frozenset({"partial_rotary_factor"}),
                 ignored=frozenset({"resid_pdrop", "embd_pdrop"}) | (_WINDOWED - {"sliding_window"}),
                 defaults=dict(rms_norm_eps=1e-5)),
    Architecture("gemma2", "Gemma2ForCausalLM", qkv_bias="attention_bias", o_proj_bias="attention_bias",
                 norms=LayerNorms("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                                  "post_feedforward_layernorm"),
                 activation_field="hidden_activation", activations=("gelu_pytorch_tanh",),
                 norm_weight_offset=1.0, scale_embeddings=True, final_softcap_field="final_logit_softcapping",
                 attn_softcap_field="attn_logit_softcapping", attention_scale_field="query_pre_attn_scalar",
                 windows="layer_types", ignored=frozenset({"hidden_act", "use_sliding_window", "max_window_layers"}),
                 defaults=dict(head_dim=256, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
                               sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                               tie_word_embeddings=True)),
)}
ARCHITECTURE_NAMES = {a.hf_class: a for a in ARCHITECTURES.values()}


class UnknownArchitecture(ValueError):
    """A model_type (or architectures entry) with no entry in the table."""


def architecture(model_type: object) -> Architecture:
    if model_type not in ARCHITECTURES:
        raise UnknownArchitecture(
            f"model_type {model_type!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type]
