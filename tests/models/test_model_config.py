"""config.json is read strictly: what the engine implements is read, what is harmless is ignored,
anything else at a non-neutral value refuses the model with one line naming the field."""

from __future__ import annotations

import pytest

from kvfleet.compute_service.model.architectures import ARCHITECTURES
from kvfleet.compute_service.model.config import ModelConfig, ModelLoadError
from kvfleet.compute_service.model.rope_config import RopeConfig, read_rope

LLAMA = dict(model_type="llama", vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def config(**fields) -> ModelConfig:
    raw = {**LLAMA, **fields}
    return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not ...})


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_every_field_transformers_writes_is_known(model_type):
    """The full default config (every field the architecture has in transformers 5.24) loads, and
    reads as transformers reads it where the architectures differ."""
    import transformers

    hf = transformers.AutoConfig.for_model(model_type)
    config = ModelConfig.from_dict(hf.to_dict())
    assert config.model_type == model_type
    assert config.head_dim == getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert (config.rms_norm_eps, config.tie_word_embeddings) == (hf.rms_norm_eps, hf.tie_word_embeddings)


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_omitted_fields_take_transformers_defaults(model_type):
    """A config.json that omits a field (transformers 4 wrote only what differs from the defaults) is
    read with transformers' default for that architecture, not a family-wide one."""
    import transformers

    hf = transformers.AutoConfig.for_model(model_type)
    sizes = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id")
    full, bare = ModelConfig.from_dict(hf.to_dict()), ModelConfig.from_dict({k: getattr(hf, k) for k in sizes})
    assert bare == full


@pytest.mark.parametrize("fields, named", [
    (dict(num_experts=8), "num_experts=8"),                                        # unknown field
    (dict(quantization_config={"quant_method": "awq"}), "quantization_config"),    # unknown, not neutral
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),               # top level
    (dict(model_type="mistral", mlp_bias=True), "mlp_bias=True"),                  # not a mistral field
    (dict(model_type="mistral", attention_bias=True), "attention_bias=True"),
    (dict(model_type="qwen3", mlp_bias=True), "mlp_bias=True"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(model_type="gemma"), "model_type 'gemma'"),
    (dict(model_type="phi3", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                                                "long_factor": [2.0] * 8}), "rope type 'longrope' is not supported"),
    (dict(model_type="phi3", rope_parameters=..., rope_scaling={"type": "su", "factor": 2.0}), "rope type 'longrope'"),
    (dict(model_type="phi3", rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope type 'linear'"),
    (dict(model_type="phi3", attention_bias=True), "attention_bias=True"),
    (dict(model_type="phi3", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1}), "RoPE turns 1"),
    (dict(model_type="gemma2", hidden_activation="silu"), "hidden_activation 'silu'"),
    (dict(model_type="gemma2", use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    (dict(model_type="gemma2", attn_logit_softcapping=-1.0), "attn_logit_softcap must be positive"),
    (dict(model_type="gemma2", query_pre_attn_scalar=None), "query_pre_attn_scalar"),
    (dict(model_type="gemma2", layer_types=["sliding_attention"] * 2, sliding_window=None), "no window"),
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


def test_phi3_and_gemma2_read_what_they_add():
    phi3 = config(model_type="phi3", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5},
                  sliding_window=64)
    assert (phi3.rotary_dim, phi3.head_dim, phi3.layer_windows, phi3.qkv_bias) == (8, 16, (64, 64), False)
    legacy = config(model_type="phi3", rope_parameters=..., rope_theta=1e4, partial_rotary_factor=0.5)
    assert legacy.rotary_dim == 8
    gemma2 = config(model_type="gemma2", head_dim=24, query_pre_attn_scalar=20, num_hidden_layers=3)
    assert gemma2.attention_scale == 20 ** -0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.layer_windows == (4096, None, 4096) and gemma2.tie_word_embeddings
    uncapped = config(model_type="gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (uncapped.attn_logit_softcap, uncapped.final_logit_softcap) == (None, None)


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
