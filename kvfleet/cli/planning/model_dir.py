"""A ``ModelShape`` from a Hugging Face model directory's ``config.json``. No torch.

GQA models go through the engine's own parser (``ModelConfig.from_dir``, which reads each
architecture's entry in ``kvfleet.compute_service.model.architectures``: defaults, biases, head_dim), so the
plan refuses what the engine refuses and reads the same shapes; MLA configs (``kv_lora_rank``: DeepSeek-V2/V3), which
the engine does not serve, are read here field by field.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfleet.cli.planning.shapes import MLAShape, ModelShape, MoEShape
from kvfleet.compute_service.model.config import ModelConfig, ModelLoadError

DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}


def _mla_config(model_dir: str | Path) -> dict | None:
    """The raw config if it describes an MLA model, else None (the engine's parser then says
    what is wrong with the directory)."""
    try:
        raw = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and "kv_lora_rank" in raw else None


def _dtype(raw: dict) -> tuple[str, float]:
    """The activations' dtype (what ``--kv-cache-dtype auto`` means) and bytes per stored weight
    (an FP8-quantised checkpoint stores one byte, its block scales not counted)."""
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise ModelLoadError(f"config.json: torch_dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    quant = raw.get("quantization_config") or {}
    return dtype, 1.0 if quant.get("quant_method") == "fp8" else DTYPE_BYTES[dtype]


def _int(raw: dict, key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"config.json: field {key!r} must be an integer, got {value!r}")
    return value


def _mla_shape(raw: dict, name: str) -> ModelShape:
    dtype, weight_bytes = _dtype(raw)
    experts = raw.get("n_routed_experts")
    moe = None if not experts else MoEShape(
        num_experts=experts, num_shared_experts=_int(raw, "n_shared_experts", 0),
        experts_per_token=_int(raw, "num_experts_per_tok"), expert_intermediate_size=_int(raw, "moe_intermediate_size"),
        first_k_dense=_int(raw, "first_k_dense_replace", 0))
    heads = _int(raw, "num_attention_heads")
    mla = MLAShape(q_lora_rank=raw.get("q_lora_rank") or 0, kv_lora_rank=_int(raw, "kv_lora_rank"),
                   qk_nope_head_dim=_int(raw, "qk_nope_head_dim"), qk_rope_head_dim=_int(raw, "qk_rope_head_dim"),
                   v_head_dim=_int(raw, "v_head_dim"))
    return ModelShape(
        name, _int(raw, "num_hidden_layers"), _int(raw, "hidden_size"), _int(raw, "intermediate_size"), heads,
        heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, _int(raw, "vocab_size"),
        _int(raw, "max_position_embeddings"), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        weight_bytes=weight_bytes, dtype=dtype, mla=mla, moe=moe)


def shape_from_dir(model_dir: str | Path) -> ModelShape:
    name = Path(model_dir).resolve().name
    raw = _mla_config(model_dir)
    if raw is not None:
        try:
            return _mla_shape(raw, name)
        except ValueError as exc:
            raise ModelLoadError(f"{model_dir}: {exc}") from None
    config = ModelConfig.from_dir(model_dir)  # validated: config.json exists and holds an object
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    dtype, weight_bytes = _dtype(raw)
    return ModelShape(
        name, config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
        config.num_kv_heads, config.head_dim, config.vocab_size, config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, attention_bias=config.qkv_bias,
        weight_bytes=weight_bytes, dtype=dtype)
