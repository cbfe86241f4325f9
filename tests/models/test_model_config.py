"""config.json is read strictly: what the engine implements is read, what is harmless is ignored,
anything else at a non-neutral value refuses the model with one line naming the field."""

from __future__ import annotations

import pytest

from compute_service.model.config import ModelConfig, ModelLoadError
from compute_service.model.rope_config import RopeConfig, read_rope

LLAMA = dict(model_type="llama", vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def config(**fields) -> ModelConfig:
    raw = {**LLAMA, **fields}
    return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not ...})


@pytest.mark.parametrize("class_name", ["LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config"])
def test_every_field_transformers_writes_is_known(class_name):
    """The full default config (every field the architecture has in transformers 5.24) loads."""
    import transformers

    raw = {**getattr(transformers, class_name)().to_dict(), "sliding_window": None}  # Mistral's default slides
    assert ModelConfig.from_dict(raw).model_type == raw["model_type"]


@pytest.mark.parametrize("fields, named", [
    (dict(num_experts=8), "num_experts=8"),                                        # unknown field
    (dict(quantization_config={"quant_method": "awq"}), "quantization_config"),    # unknown, not neutral
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),               # top level
    (dict(model_type="mistral", mlp_bias=True), "mlp_bias=True"),                  # not a mistral field
    (dict(model_type="mistral", attention_bias=True), "attention_bias=True"),
    (dict(model_type="qwen3", mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(model_type="gemma"), "model_type 'gemma'"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope type 'longrope'"),
    (dict(rope_parameters=..., rope_scaling={"type": "su", "factor": 2.0}), "rope type 'su'"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     "rope key partial_rotary_factor=0.5"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "beta_fast": 4}), "rope key beta_fast=4"),
    (dict(rope_parameters={"rope_type": "linear"}), "needs a factor"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer-type"),
    (dict(model_type="qwen2", use_sliding_window="yes", sliding_window=64), "use_sliding_window"),
    (dict(model_type="qwen3", use_sliding_window=False, layer_types=["sliding_attention"] * 2),
     "no window"),
])
def test_unimplemented_fields_refuse_the_model(fields, named):
    with pytest.raises(ModelLoadError) as info:
        config(**fields)
    message = str(info.value)
    assert named in message and "\n" not in message


@pytest.mark.parametrize("fields", [
    dict(num_experts=None, use_mrope=False, pruned_heads={}),       # unknown but neutral
    dict(torch_dtype="bfloat16", attention_dropout=0.1, pretraining_tp=2, temperature=0.7),  # harmless
    dict(model_type="qwen2", attention_bias=False),                 # transformers' Qwen2 ignores it
    dict(model_type="qwen2", use_sliding_window=False, sliding_window=64),
    dict(model_type="mistral", sliding_window=4096),                # longer than the context
])
def test_harmless_fields_are_accepted(fields):
    config(**fields)


def test_sliding_windows_are_read_per_layer():
    assert config(model_type="mistral", sliding_window=64).layer_windows == (64, 64)
    assert config(model_type="qwen2", use_sliding_window=True, sliding_window=64,
                  max_window_layers=1).layer_windows == (None, 64)
    assert config(model_type="qwen2", use_sliding_window=False, sliding_window=64).layer_windows == (None, None)


def test_biases_and_norms_follow_the_architecture():
    llama = config(attention_bias=True, mlp_bias=True)
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias, llama.qk_norm) == (True, True, True, False)
    qwen2 = config(model_type="qwen2")
    assert (qwen2.qkv_bias, qwen2.o_proj_bias, qwen2.mlp_bias, qwen2.qk_norm) == (True, False, False, False)
    qwen3 = config(model_type="qwen3")
    assert (qwen3.qkv_bias, qwen3.o_proj_bias, qwen3.qk_norm) == (False, False, True)


LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


@pytest.mark.parametrize("current, legacy", [
    ({"rope_type": "default", "rope_theta": 5e5}, dict(rope_theta=5e5)),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, dict(rope_scaling={"type": "linear", "factor": 2.0})),
    ({"rope_type": "dynamic", "factor": 3.0, "rope_theta": 1e4}, dict(rope_scaling={"rope_type": "dynamic", "factor": 3})),
    ({"rope_type": "llama3", "rope_theta": 5e5, **LLAMA3}, dict(rope_theta=5e5, rope_scaling={"type": "llama3", **LLAMA3})),
    ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4, "original_max_position_embeddings": 64},
     dict(rope_scaling={"type": "yarn", "factor": 4.0}, original_max_position_embeddings=64)),
])
def test_both_rope_formats_read_the_same(current, legacy):
    assert read_rope({"rope_parameters": current}, 256) == read_rope(legacy, 256)


def test_rope_reading_follows_transformers_priorities():
    # rope_scaling wins over rope_parameters; a top-level original length over the dict's
    raw = dict(rope_theta=7.0, rope_parameters={"rope_type": "linear", "factor": 2.0},
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
               original_max_position_embeddings=16)
    rope = read_rope(raw, 256)
    assert (rope.rope_type, rope.theta, rope.factor, rope.original_max_position_embeddings) == ("yarn", 7.0, 4.0, 16)
    # yarn without a factor: the ratio of the lengths; attention factor from mscale / mscale_all_dim
    rope = read_rope({"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 64,
                                          "mscale": 1.0, "mscale_all_dim": 0.5}}, 256)
    assert rope.factor == 4.0 and rope.attention_factor == pytest.approx((0.1 * 1.386294 + 1) / (0.05 * 1.386294 + 1))


@pytest.mark.parametrize("rope, context", [
    (RopeConfig("default", 1e4), 256), (RopeConfig("linear", 1e4, 2.0), 512), (RopeConfig("dynamic", 1e4, 4.0), 1024),
    (RopeConfig("yarn", 1e4, 4.0, 128), 512), (RopeConfig("llama3", 1e4, 8.0, 64), 256),
])
def test_scaled_ropes_extend_the_context(rope, context):
    assert rope.context_len(256) == context
