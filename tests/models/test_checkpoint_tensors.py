"""Every checkpoint tensor is used and every parameter filled, or the load fails naming the tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfleet.compute_service.model.config import ModelConfig, ModelLoadError
from kvfleet.compute_service.model.weights import load_model
from tests.models.hf_models import build


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Llama with o_proj and MLP biases: (directory, its tensors)."""
    model_dir = build(tmp_path_factory.mktemp("ckpt") / "llama", "attention_bias")
    config = json.loads((model_dir / "config.json").read_text())
    config["mlp_bias"] = True
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name in ("gate_proj", "up_proj", "down_proj"):
        for i in range(config["num_hidden_layers"]):
            out = config["hidden_size"] if name == "down_proj" else config["intermediate_size"]
            tensors[f"model.layers.{i}.mlp.{name}.bias"] = torch.randn(out)
    return model_dir, config, tensors


def write(tmp_path, saved, tensors=None, **fields):
    model_dir, config, all_tensors = saved
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    save_file(all_tensors if tensors is None else tensors, str(out / "model.safetensors"))
    return out


def load(model_dir):
    return load_model(model_dir, ModelConfig.from_dir(model_dir), torch.float32, torch.device("cpu"))


def test_a_complete_checkpoint_loads_with_every_bias(tmp_path, saved):
    model = load(write(tmp_path, saved))
    assert model.layers[1].self_attn.o_proj.bias is not None and model.layers[1].mlp.down_proj.bias is not None
    torch.testing.assert_close(model.layers[1].self_attn.o_proj.bias.data,
                               saved[2]["model.layers.1.self_attn.o_proj.bias"])


def test_an_extra_tensor_is_refused_by_name(tmp_path, saved):
    tensors = {**saved[2], "model.layers.0.self_attn.rotary_emb.extra": torch.zeros(4)}
    with pytest.raises(ModelLoadError, match="1 tensor.*not use.*'model.layers.0.self_attn.rotary_emb.extra'"):
        load(write(tmp_path, saved, tensors))


def test_biases_a_config_turns_off_are_refused_not_dropped(tmp_path, saved):
    """The silent failure of the past: biases in the checkpoint the config does not announce."""
    with pytest.raises(ModelLoadError, match="6 tensor.*not use.*'model.layers.0.mlp.down_proj.bias'"):
        load(write(tmp_path, saved, mlp_bias=False))


def test_a_missing_tensor_is_refused_by_name(tmp_path, saved):
    tensors = {k: v for k, v in saved[2].items() if k != "model.layers.1.self_attn.o_proj.bias"}
    with pytest.raises(ModelLoadError, match="lacks 1 tensor.*'model.layers.1.self_attn.o_proj.bias'"):
        load(write(tmp_path, saved, tensors))


def test_a_fused_checkpoint_loads_and_an_unfused_one_is_refused(tmp_path):
    """Phi-3 stores q/k/v and gate/up fused: taken whole; the same tensors split the Llama way are
    not what a Phi-3 config describes, and are named."""
    model_dir = build(tmp_path / "phi3", "phi3")
    tensors = load_file(str(model_dir / "model.safetensors"))
    model = load(model_dir)
    torch.testing.assert_close(model.layers[0].self_attn.qkv_proj.weight.data,
                               tensors["model.layers.0.self_attn.qkv_proj.weight"])
    split = dict(tensors)
    q, k, v = split.pop("model.layers.0.self_attn.qkv_proj.weight").split([64, 32, 32])
    split.update({"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
                  "model.layers.0.self_attn.v_proj.weight": v})
    save_file(split, str(model_dir / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks 1 tensor.*'model.layers.0.self_attn.qkv_proj.weight'"):
        load(model_dir)
