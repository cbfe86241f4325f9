"""What the engine needs from a model directory's ``config.json``, validated with errors that name
the file and the field.

Strict: every field of ``config.json`` is either implemented (read into ``ModelConfig``), known to
be harmless whatever its value (``IGNORED_FIELDS``: bookkeeping, training-only settings), or
refused unless it holds its neutral value. A field the engine silently skipped would serve wrong
tokens with no error, which is worse than refusing the model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvfleet.compute_service.model.architectures import ARCHITECTURES, Architecture, UnknownArchitecture, architecture
from kvfleet.compute_service.model.rope_config import RopeConfig, RopeConfigError, read_rope
from kvfleet.compute_service.model.sliding_window import RULE_FIELDS, WindowConfigError, layer_windows

SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)

# read by every supported architecture (the rest: its entry in ``architectures``)
CORE_FIELDS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
    "tie_word_embeddings", "bos_token_id", "eos_token_id",
})
ROPE_FIELDS = frozenset({"rope_theta", "rope_scaling", "rope_parameters", "original_max_position_embeddings"})
# harmless at any value: bookkeeping, training-only settings, and fields transformers' model ignores
IGNORED_FIELDS = frozenset({
    "architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path", "use_cache",
    "initializer_range", "pad_token_id", "attention_dropout",  # dropout is off at inference
    "pretraining_tp",            # transformers 5 Llama no longer reads it
    "chunk_size_feed_forward",   # a memory saving: the same result computed in chunks
    "output_attentions", "output_hidden_states", "return_dict", "torchscript", "tokenizer_class",
    "id2label", "label2id", "problem_type", "finetuning_task", "task_specific_params", "prefix",
    "use_bfloat16", "tf_legacy_loss", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "sep_token_id", "decoder_start_token_id",
}) | frozenset({  # transformers 4's generation defaults: sampling here comes from each request
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
})


class ModelLoadError(ValueError):
    """A model directory that cannot be served: missing or malformed file, unsupported config."""


@dataclass(slots=True)
class ModelConfig:
    architecture: Architecture    # what this model type does differently (``architectures``)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    qkv_bias: bool                # q/k/v projections carry a bias
    o_proj_bias: bool
    mlp_bias: bool                # gate/up/down projections carry a bias
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    attention_scale: float        # q.k multiplier: head_dim ** -0.5 unless the architecture names a field
    hidden_act: str = "silu"      # the gated MLP's activation
    attn_logit_softcap: float | None = None   # attention scores -> cap * tanh(score / cap)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window in tokens, None = full

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ModelLoadError(f"config.json: RoPE turns {self.rotary_dim} dimensions of each head, "
                                 "which must be even and positive")
        for name in ("attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ModelLoadError(f"config.json: {name} must be positive or null, got {getattr(self, name)}")

    @property
    def model_type(self) -> str:
        return self.architecture.model_type

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm of q and k before RoPE (Qwen3)."""
        return self.architecture.qk_norm

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim(self.head_dim)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model serves (RoPE scaling may extend max_position_embeddings)."""
        return self.rope.context_len(self.max_position_embeddings)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        if not path.is_file():
            raise ModelLoadError(f"{path} is missing")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} must hold a JSON object")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        try:
            arch = architecture(raw.get("model_type"))
        except UnknownArchitecture as exc:
            raise ModelLoadError(f"{source}: {exc}") from None
        _refuse_unimplemented(raw, arch, source)
        raw = {**arch.defaults, **raw}
        act = raw.get(arch.activation_field, arch.activations[0])
        if act not in arch.activations:
            raise ModelLoadError(f"{source}: {arch.activation_field} {act!r} is not supported for {arch.model_type} "
                                 f"models ({', '.join(arch.activations)} only)")

        def need(key: str, default: int | None = None) -> int:
            value = raw.get(key) if raw.get(key) is not None else default
            if value is None:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            if not isinstance(value, int) or isinstance(value, bool):
                raise ModelLoadError(f"{source}: field {key!r} must be an integer, got {value!r}")
            return value

        def cap(name: str | None) -> float | None:
            value = raw.get(name) if name else None
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ModelLoadError(f"{source}: field {name!r} must be a number or null, got {value!r}")
            return None if value is None else float(value)

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        max_pos = need("max_position_embeddings")
        try:
            rope = read_rope(raw, max_pos, arch)
            windows = layer_windows(raw, need("num_hidden_layers"))
        except (RopeConfigError, WindowConfigError) as exc:
            raise ModelLoadError(f"{source}: {exc}") from None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        head_dim = need("head_dim", hidden // heads)
        scale_field = arch.attention_scale_field
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=need("num_key_value_heads", heads),
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            qkv_bias=arch.switch(arch.qkv_bias, raw),
            o_proj_bias=arch.switch(arch.o_proj_bias, raw),
            mlp_bias=arch.switch(arch.mlp_bias, raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            hidden_act=act,
            attention_scale=(need(scale_field) if scale_field else head_dim) ** -0.5,
            attn_logit_softcap=cap(arch.attn_softcap_field),
            final_logit_softcap=cap(arch.final_softcap_field),
            layer_windows=windows,
        )


def _refuse_unimplemented(raw: dict, arch: Architecture, source: str) -> None:
    """A field outside what ``arch`` implements or ignores must be absent, null, false or empty."""
    known = (CORE_FIELDS | ROPE_FIELDS | IGNORED_FIELDS | RULE_FIELDS[arch.windows] | arch.read_fields()
             | arch.ignored)
    for name, value in raw.items():
        if name not in known and not (value is None or value is False or value == {} or value == []):
            raise ModelLoadError(f"{source}: field {name}={value!r} is not supported for {arch.model_type} models")

