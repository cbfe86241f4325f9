"""Load ``*.safetensors`` weights in Hugging Face naming into ``CausalLM``, fusing q/k/v and
gate/up. Every problem is a ``ModelLoadError`` naming the file and the tensor."""

from __future__ import annotations

from pathlib import Path

import torch

from compute_service.model import CausalLM
from compute_service.model_config import ModelConfig, ModelLoadError
from compute_service.rope import RotaryEmbedding

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} holds no *.safetensors weights file")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            tensors.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{path} is not a readable safetensors file: {exc}") from exc
    return tensors


def load_model(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
               device: torch.device) -> CausalLM:
    model_dir = Path(model_dir)
    tensors = read_safetensors(model_dir)

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise ModelLoadError(f"{model_dir}: weight {name!r} is missing")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{model_dir}: weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    state: dict[str, torch.Tensor] = {
        "embed_tokens.weight": take("model.embed_tokens.weight", (c.vocab_size, c.hidden_size)),
        "norm.weight": take("model.norm.weight", (c.hidden_size,)),
    }
    if not c.tie_word_embeddings:
        state["lm_head.weight"] = take("lm_head.weight", (c.vocab_size, c.hidden_size))
    for i in range(c.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        state[dst + "self_attn.qkv_proj.weight"] = torch.cat([
            take(attn + "q_proj.weight", (q, c.hidden_size)),
            take(attn + "k_proj.weight", (kv, c.hidden_size)),
            take(attn + "v_proj.weight", (kv, c.hidden_size))])
        if c.attention_bias:
            state[dst + "self_attn.qkv_proj.bias"] = torch.cat([
                take(attn + "q_proj.bias", (q,)), take(attn + "k_proj.bias", (kv,)),
                take(attn + "v_proj.bias", (kv,))])
        state[dst + "self_attn.o_proj.weight"] = take(attn + "o_proj.weight", (c.hidden_size, q))
        mlp = src + "mlp."
        state[dst + "mlp.gate_up_proj.weight"] = torch.cat([
            take(mlp + "gate_proj.weight", (c.intermediate_size, c.hidden_size)),
            take(mlp + "up_proj.weight", (c.intermediate_size, c.hidden_size))])
        state[dst + "mlp.down_proj.weight"] = take(mlp + "down_proj.weight", (c.hidden_size, c.intermediate_size))
        state[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight", (c.hidden_size,))
        state[dst + "post_attention_layernorm.weight"] = take(
            src + "post_attention_layernorm.weight", (c.hidden_size,))

    with torch.device(device):
        model = CausalLM(c)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)
    model = model.to(dtype=dtype)
    # RoPE tables stay float32 whatever the weights' dtype (they are cast per use)
    with torch.device(device):
        model.rope = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)
    return model.eval()
