"""Tiny random models built and saved by transformers itself, one per config feature, and its
greedy tokens as the reference.

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

from kvfleet_cli.model_maker import build_tokenizer

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
# name → (transformers config class, config fields)
CASES: dict[str, tuple[str, dict]] = {
    **{f"rope_{name}": ("LlamaConfig", dict(rope_parameters={"rope_theta": 5000.0, **rope},
                                             **(dict(max_position_embeddings=64) if name == "dynamic" else {})))
       for name, rope in ROPES.items()},
    "attention_bias": ("LlamaConfig", dict(attention_bias=True)),
    "mlp_bias": ("LlamaConfig", dict(mlp_bias=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=24)),
    # odd shapes: 5 query heads per KV head, head_dim 40 != hidden/heads, a vocabulary above the tokenizer's
    "qwen2_odd": ("Qwen2Config", dict(ODD, tie_word_embeddings=True)),
    "qwen3_odd": ("Qwen3Config", dict(ODD, attention_bias=True, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
}


def build(out: Path, case: str, legacy: bool = False, seed: int = 0, rope_theta_times: float = 1.0) -> Path:
    """Save ``case`` to ``out`` (config.json, model.safetensors, tokenizer.json) and return it."""
    import transformers

    class_name, fields = CASES[case]
    config = getattr(transformers, class_name)(**{**BASE, **fields}, initializer_range=0.25)
    config.rope_parameters["rope_theta"] *= rope_theta_times
    torch.manual_seed(seed)
    model = getattr(transformers, class_name.replace("Config", "ForCausalLM"))(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
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
