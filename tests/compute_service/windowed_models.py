"""Sliding-window test models built by transformers itself (random weights, seeded), and its greedy
tokens, shared by the in-process and cluster tests.

Small (hidden 64, 2-4 layers) but sensitive: ``initializer_range`` 0.2 makes attention peaked enough
that the window changes transformers' own tokens on the test prompts (the tests assert it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvfleet.cli.model_maker import EOS_ID, PAD_ID, make_model
from kvfleet.compute_service.model.architectures import ARCHITECTURES
from kvfleet.compute_service.model.sliding_window import RULE_OFF

SMALL = dict(vocab_size=260, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.2,
             bos_token_id=256, eos_token_id=EOS_ID, pad_token_id=PAD_ID, tie_word_embeddings=False)

# name -> (model_type, config fields): a window below, across and not a multiple of the block size 16
WINDOWED = {
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=24)),
    "qwen2": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=40, max_window_layers=0)),
    # the first layer attends in full: no block of a sequence can be given back
    "qwen2_mixed": ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=24,
                                   max_window_layers=1)),
}


def make_windowed_model(out: Path, name: str, seed: int = 0, windowed: bool = True) -> Path:
    """Save a transformers-built random model (float32) with the byte tokenizer of ``make_model``.
    ``windowed=False``: the same weights with the window switched off (the sensitivity check)."""
    import transformers

    model_type, fields = WINDOWED[name]
    fields = dict(fields)
    if not windowed:
        fields.update(RULE_OFF[ARCHITECTURES[model_type].windows])
    make_model(out, "tiny", architecture=model_type)  # tokenizer files; config and weights replaced below
    config = transformers.AutoConfig.for_model(model_type, **SMALL, **fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == model_type
    return out


@torch.inference_mode()
def transformers_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if ignore_eos:  # as the engine's ignore_eos: EOS is a token like any other
        model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=None if ignore_eos else EOS_ID, pad_token_id=PAD_ID)
    return out[0, len(prompt):].tolist()
