"""``kvfleet make-model``: a seeded, random-initialised model directory of any architecture the engine
serves (``kvfleet.compute_service.model.architectures``) that any Hugging Face tool can read (``config.json``,
``model.safetensors``, a byte-level ``tokenizer.json``). Its config fields and tensor names come from
that table: a new architecture needs nothing here.

No download: the tokenizer is 256 byte tokens plus four specials, built with ``tokenizers``. The
chat template is ChatML with the specials as its markers: ``<s>`` opens a turn (``<|im_start|>``),
``</s>`` ends it (``<|im_end|>``, also the model's eos, so generation stops at the end of a turn).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvfleet.compute_service.model.architectures import ARCHITECTURES
from kvfleet.compute_service.model.checkpoint_layout import is_norm, model_layout
from kvfleet.compute_service.model.config import ModelConfig
from kvfleet.compute_service.model.sliding_window import RULE_OFF

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<unk>"]
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('a system message must come first') }}"
    "{% endif %}"
    "{{ bos_token + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}"
)

PRESETS: dict[str, dict] = {
    # tests: a few layers, hidden <= 128, GQA 4 query / 2 KV heads
    "tiny": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=10000.0),
    # benchmarks: ~50M parameters, 12 query / 4 KV heads of 64
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=8192,
                  rope_theta=500000.0),
    # 128K context on a CPU: 2 layers, 2 query heads of 64 over one KV head, so a 131,072-token prefill
    # takes minutes. RoPE as Llama 3.1 ships 128K: base 500000 (the slowest of its 32 frequencies turns
    # once in ~2.1M positions, far past 131,072, so no two positions of the window rotate alike) and
    # llama3 scaling by 8 from 16,384 (the frequencies whose wavelength exceeds 16,384 / low_freq_factor
    # are slowed 8x, as in a model trained at 16K and extended), which also puts the engine's llama3
    # rotation on the 128K path.
    "long": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=131072,
                 rope_theta=500000.0,
                 rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=16384)),
}
# Weights' standard deviation by preset (default 0.05). The long preset's are strong (as the test models'
# 0.25): with weak ones attention over thousands of random tokens averages to the same vector whatever
# they are, and a wrong position, a lost block or a mis-scaled FP8 row would not change a token.
WEIGHT_STD = {"long": 0.25}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def build_tokenizer():
    """A byte-level tokenizer: token id == byte value, specials after the bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    return tokenizer


def model_config(preset: str, architecture: str = "llama", **overrides) -> dict:
    """config.json of a ``preset`` model of ``architecture`` (a model_type): the table's defaults,
    biases and sliding windows off, head_dim = hidden / heads unless overridden."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[architecture]
    config = dict(
        architectures=[arch.hf_class], model_type=arch.model_type, vocab_size=VOCAB_SIZE,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        torch_dtype="float32", attention_dropout=0.0, use_cache=True, initializer_range=0.02,
    )
    config[arch.activation_field] = arch.activations[0]
    config.update({switch: False for switch in (arch.qkv_bias, arch.o_proj_bias, arch.mlp_bias)
                   if isinstance(switch, str)})
    config.update(arch.defaults)
    config.update(RULE_OFF.get(arch.windows, {}))
    config.update(PRESETS[preset])
    config.update(overrides)
    if "head_dim" not in overrides:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return config


def random_weights(config: dict, seed: int, std: float = 0.05) -> dict:
    """One random tensor per checkpoint tensor the engine reads for ``config``: norms near their
    neutral value, the embedding at unit scale, a strong head, everything else ``std``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    mc = ModelConfig.from_dict(config)
    neutral = 1.0 - mc.architecture.norm_weight_offset  # the stored value that scales by one
    tensors = {}
    for param, parts in model_layout(mc).items():
        for name, shape in parts:
            if is_norm(name):
                tensors[name] = neutral + 0.1 * torch.randn(*shape, generator=gen)
            elif param == "embed_tokens.weight":
                tensors[name] = torch.randn(*shape, generator=gen)
            else:
                tensors[name] = torch.randn(*shape, generator=gen) * (std * 4 if param == "lm_head.weight" else std)
    return {name: t.contiguous() for name, t in tensors.items()}


def make_model(out: str | Path, preset: str = "tiny", architecture: str = "llama",
               seed: int = 0, **overrides) -> Path:
    """Write a model directory and return its path."""
    from safetensors.torch import save_file

    out = Path(out)
    config = model_config(preset, architecture, **overrides)
    out.mkdir(parents=True, exist_ok=True)
    weights = random_weights(config, seed, WEIGHT_STD.get(preset, 0.05))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    build_tokenizer().save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(dict(
        tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", unk_token="<unk>", model_max_length=config["max_position_embeddings"],
        chat_template=CHAT_TEMPLATE,
    ), indent=2))
    (out / "generation_config.json").write_text(json.dumps(dict(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID), indent=2))
    # config.json last: its presence marks a complete directory (the Makefile relies on it)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="directory to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--architecture", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    path = make_model(args.out, args.preset, args.architecture, args.seed)
    print(f"wrote {args.preset} {args.architecture} model to {path}")
    return 0
