"""What the engine needs from a model directory's ``config.json``, validated with errors that name
the file and the field."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from compute_service.sliding_window import WindowConfigError, layer_windows

SUPPORTED_MODEL_TYPES = {"llama", "qwen2", "mistral"}


class ModelLoadError(ValueError):
    """A model directory that cannot be served: missing or malformed file, unsupported config."""


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    attention_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    extra: dict = field(default_factory=dict)
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
        if self.head_dim % 2:
            raise ModelLoadError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

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
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"{source}: model_type {model_type!r} is not supported; supported: "
                f"{sorted(SUPPORTED_MODEL_TYPES)}")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{source}: hidden_act {raw.get('hidden_act')!r} is not supported (silu only)")

        def need(key: str):
            if key not in raw:
                raise ModelLoadError(f"{source}: required field {key!r} is missing")
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool):
                raise ModelLoadError(f"{source}: field {key!r} must be an integer, got {value!r}")
            return value

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        max_pos = need("max_position_embeddings")
        try:
            windows = layer_windows(raw, need("num_hidden_layers"))
        except WindowConfigError as exc:
            raise ModelLoadError(f"{source}: {exc}") from None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = raw.get("rope_scaling") or None
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rope_type not in ("llama3", "default"):
                raise ModelLoadError(f"{source}: rope_scaling type {rope_type!r} is not supported")
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            extra=raw,
            layer_windows=windows,
        )
