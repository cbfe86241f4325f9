"""The RoPE settings of a ``config.json``, read from either format into one ``RopeConfig``.

transformers < 5 wrote ``rope_theta`` at the top level and the scaling as ``rope_scaling``
(``{"type" | "rope_type": …, "factor": …}``); transformers 5 writes one ``rope_parameters`` dict
holding ``rope_theta`` and the scaling together. Both are read by ``read_rope`` with the priority
transformers gives them (``rope_scaling`` over ``rope_parameters``; a top-level
``original_max_position_embeddings`` over the dict's), so the engine rotates exactly as the
reference implementation does. A key a scaling type does not use, or a type the engine does not
implement, refuses the model: a silently ignored key would rotate every position wrong. What an
architecture allows (partial rotation, its own rope types and aliases) comes from its entry in
``architectures``.

Pure: no torch (the tables are built in ``rope.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvfleet.compute_service.model.architectures import Architecture


class RopeConfigError(ValueError):
    """A RoPE setting the engine cannot honour (one line naming the key)."""


# what each implemented type may carry besides rope_type/type/rope_theta (transformers' validators)
TYPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                       "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "llama3": frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
}
# keys any type may carry at these values without changing the rotation
NEUTRAL_KEYS = {"partial_rotary_factor": 1.0}
PARTIAL = "partial_rotary_factor"
DEFAULT_THETA = 10000.0


@dataclass(slots=True, frozen=True)
class RopeConfig:
    rope_type: str                     # one of TYPE_KEYS
    theta: float
    factor: float = 1.0                # linear/dynamic/yarn/llama3
    original_max_position_embeddings: int | None = None  # yarn/llama3: the pretraining length
    low_freq_factor: float = 1.0       # llama3
    high_freq_factor: float = 4.0      # llama3
    beta_fast: float = 32.0            # yarn: the ramp's bounds, in rotations
    beta_slow: float = 1.0
    truncate: bool = True              # yarn: round the ramp's bounds to whole dimensions
    attention_factor: float = 1.0      # yarn: cos/sin scale (derived from mscale when not given)
    partial_rotary_factor: float = 1.0  # the share of each head RoPE turns (its first dimensions)

    def __post_init__(self) -> None:
        if self.theta <= 0 or self.factor <= 0:
            raise RopeConfigError(f"rope_theta and factor must be positive, got {self.theta} and {self.factor}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise RopeConfigError(f"rope partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
            raise RopeConfigError("llama3 rope: high_freq_factor must differ from low_freq_factor")

    def context_len(self, max_position_embeddings: int) -> int:
        """The longest context the engine serves: the scaled length for types meant to extend it
        (vLLM's rule), else ``max_position_embeddings``."""
        if self.rope_type in ("linear", "dynamic"):
            return int(max_position_embeddings * self.factor)
        if self.rope_type == "yarn":
            return max(max_position_embeddings, int(self.original_max_position_embeddings * self.factor))
        return max_position_embeddings

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's first dimensions RoPE turns (transformers: ``int(head_dim * factor)``)."""
        return int(head_dim * self.partial_rotary_factor)


def _number(params: dict, key: str, default: float | None) -> float | None:
    value = params.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RopeConfigError(f"rope {key} must be a number, got {value!r}")
    return float(value)


def _yarn_attention_factor(params: dict, factor: float) -> float:
    """transformers' ``get_mscale`` rule: 0.1·ln(factor)+1, or the mscale/mscale_all_dim ratio."""
    given = _number(params, "attention_factor", None)
    if given is not None:
        return given

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


def read_rope(raw: dict, max_position_embeddings: int, arch: Architecture | None = None) -> RopeConfig:
    """The RoPE of a config.json dict (either format) for ``arch`` (None: no partial rotation, any
    implemented type); ``RopeConfigError`` names what is refused."""
    scaling, parameters = raw.get("rope_scaling"), raw.get("rope_parameters")
    for name, value in (("rope_scaling", scaling), ("rope_parameters", parameters)):
        if value is not None and not isinstance(value, dict):
            raise RopeConfigError(f"{name} must be an object, got {value!r}")
    params = dict(scaling or parameters or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise RopeConfigError("per-layer-type rope parameters are not supported")
    theta = _number(params, "rope_theta", _number(raw, "rope_theta", DEFAULT_THETA))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = arch.rope_aliases.get(rope_type, rope_type) if arch else rope_type
    allowed = sorted(arch.rope_types if arch and arch.rope_types is not None else TYPE_KEYS)
    if rope_type not in TYPE_KEYS or rope_type not in allowed:
        raise RopeConfigError(f"rope type {rope_type!r} is not supported; supported: {allowed}")
    partial = _number(params, PARTIAL, _number(raw, PARTIAL, 1.0)) if arch and arch.partial_rotary else 1.0
    for key, value in params.items():
        if key in ("rope_type", "type", "rope_theta") or key in TYPE_KEYS[rope_type]:
            continue
        if key == PARTIAL and arch and arch.partial_rotary:
            continue
        if key in NEUTRAL_KEYS and value == NEUTRAL_KEYS[key]:
            continue
        raise RopeConfigError(f"rope key {key}={value!r} is not supported for rope type {rope_type!r}")
    if rope_type == "default":
        return RopeConfig("default", theta, partial_rotary_factor=partial)
    factor = _number(params, "factor", None)
    original = raw.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings", max_position_embeddings))
    if rope_type == "yarn" and factor is None:
        factor = max_position_embeddings / original
    if factor is None:
        raise RopeConfigError(f"rope type {rope_type!r} needs a factor")
    if rope_type in ("linear", "dynamic"):
        return RopeConfig(rope_type, theta, factor, partial_rotary_factor=partial)
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise RopeConfigError(f"rope original_max_position_embeddings must be a positive integer, got {original!r}")
    if rope_type == "llama3":
        low, high = _number(params, "low_freq_factor", None), _number(params, "high_freq_factor", None)
        if low is None or high is None:
            raise RopeConfigError("rope type 'llama3' needs low_freq_factor and high_freq_factor")
        return RopeConfig("llama3", theta, factor, original, low_freq_factor=low, high_freq_factor=high,
                          partial_rotary_factor=partial)
    return RopeConfig("yarn", theta, factor, original,
                      beta_fast=_number(params, "beta_fast", None) or 32.0,
                      beta_slow=_number(params, "beta_slow", None) or 1.0,
                      truncate=bool(params.get("truncate", True)),
                      attention_factor=_yarn_attention_factor(params, factor), partial_rotary_factor=partial)
