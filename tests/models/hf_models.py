"""Tiny random models built and saved by transformers itself, one per config feature and at least one
per architecture of ``kvfleet.compute_service.model.architectures`` (its test row), and its greedy tokens as
the reference.

Weights are made strong (std 0.25 instead of 0.02, random biases and norm weights instead of
zeros and ones) so that a wrong rotation or a missing bias changes the greedy tokens;
``test_models_are_sensitive`` keeps that honest. ``legacy=True`` rewrites the saved config.json
the way transformers 4 wrote it (``rope_theta`` + ``rope_scaling``) instead of transformers 5's
``rope_parameters``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from kvfleet.cli.model_maker import build_tokenizer
from kvfleet.compute_service.model.architectures import ARCHITECTURES

BASE = dict(vocab_size=260, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
ORIGINAL = 64  # the RoPE scaling's original length: the 100-token prompts cross it
ROPES = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),   # relative to max_position_embeddings (set to 64)
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    "yarn_mscale": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL, beta_fast=16,
                        beta_slow=2, mscale=1.0, mscale_all_dim=0.5, truncate=False),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
}
ODD = dict(num_attention_heads=5, num_key_value_heads=1, head_dim=40, vocab_size=301)
WINDOW = 40  # the 100-token prompts cross it
# Phi-3: fused qkv/gate_up checkpoints, RoPE over a share of each head
PHI3_ROPE = dict(rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.75})
# Gemma 2: head_dim != hidden/heads, its own attention scale, soft-caps low enough to bite these weights
# (attention scores reach ~20, logits ~5), even layers sliding (a window of 40 changes no token here)
GEMMA2 = dict(head_dim=24, query_pre_attn_scalar=20, attn_logit_softcapping=10.0, final_logit_softcapping=5.0,
              sliding_window=24, num_hidden_layers=3)
# name → (model_type, config fields)
CASES: dict[str, tuple[str, dict]] = {
    **{f"rope_{name}": ("llama", dict(rope_parameters={"rope_theta": 5000.0, **rope},
                                      **(dict(max_position_embeddings=64) if name == "dynamic" else {})))
       for name, rope in ROPES.items()},
    "attention_bias": ("llama", dict(attention_bias=True)),
    "mlp_bias": ("llama", dict(mlp_bias=True)),
    "qwen3": ("qwen3", dict(head_dim=24)),
    # odd shapes: 5 query heads per KV head, head_dim 40 != hidden/heads, a vocabulary above the tokenizer's
    "qwen2_odd": ("qwen2", dict(ODD, tie_word_embeddings=True)),
    "qwen3_odd": ("qwen3", dict(ODD, attention_bias=True, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "phi3": ("phi3", PHI3_ROPE),
    "phi3_window": ("phi3", dict(PHI3_ROPE, sliding_window=WINDOW, tie_word_embeddings=True)),
    "gemma2": ("gemma2", GEMMA2),
    # 8 query heads over one KV head (Gemma 2 needs hidden % heads == 0), biases, a tied head (its default)
    "gemma2_odd": ("gemma2", dict(GEMMA2, num_attention_heads=8, num_key_value_heads=1, head_dim=40, vocab_size=301,
                                  attention_bias=True)),
}


def build(out: Path, case: str, legacy: bool = False, seed: int = 0, rope_theta_times: float = 1.0,
          **changes) -> Path:
    """Save ``case`` (its fields updated by ``changes``) to ``out`` (config.json, model.safetensors,
    tokenizer.json) and return it."""
    import transformers

    model_type, fields = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **fields, **changes}, initializer_range=0.25)
    config.rope_parameters["rope_theta"] *= rope_theta_times
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == [ARCHITECTURES[model_type].hf_class]
    build_tokenizer().save(str(out / "tokenizer.json"))
    if legacy:
        to_legacy(out / "config.json")
    return out


def to_legacy(path: Path) -> None:
    """transformers 4's layout: ``rope_theta`` at the top, the scaling as ``rope_scaling`` (``type``)."""
    raw = json.loads(path.read_text())
    params = dict(raw.pop("rope_parameters"))
    raw["rope_theta"] = params.pop("rope_theta")
    if params.get("rope_type", "default") != "default":
        params["type"] = params.pop("rope_type")
        raw["rope_scaling"] = params
    path.write_text(json.dumps(raw, indent=2))


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@torch.inference_mode()
def reference_tokens(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time, each on a freshly loaded model (dynamic
    NTK keeps state across calls: a fresh model makes each prompt's reference its own)."""
    import transformers

    out = []
    for p in prompts:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ids = model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out
