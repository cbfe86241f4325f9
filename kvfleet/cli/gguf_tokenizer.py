"""A Hugging Face tokenizer rebuilt from a GGUF file's ``tokenizer.*`` metadata.

A GGUF file carries its tokenizer as plain lists (``tokenizer.ggml.tokens``, ``.merges``,
``.token_type``) plus the name of llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``). For a
``gpt2``-model file (byte-level BPE: SmolLM2, Qwen2, Llama 3, ...) that is everything a
``tokenizers`` BPE needs; the pre-tokenizer name selects the split that llama.cpp applies before
BPE (``smollm``: every digit apart, then GPT-2's regex). Control tokens (type 3) become special
added tokens, user-defined ones (type 4) plain added tokens, as in the original ``tokenizer.json``.

Pure: ``tokenizers`` only, no torch, no grpc.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

CONTROL, USER_DEFINED = 3, 4

# llama.cpp pre-tokenizer name -> digits split individually before the byte-level regex?
# (the byte-level regex itself is GPT-2's for all of these)
GPT2_STYLE_PRE = {"smollm": True, "gpt-2": False, "default": False}


class TokenizerMetadataError(ValueError):
    """The file's tokenizer is missing or of a kind this converter does not rebuild."""


@dataclass(slots=True, frozen=True)
class GGUFTokenizerSpec:
    """What the file's metadata says about its tokenizer, checked."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    chat_template: str | None

    @classmethod
    def from_metadata(cls, meta: dict) -> "GGUFTokenizerSpec":
        """``meta``: GGUF key -> value (lists as lists)."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerMetadataError("the file holds no tokenizer (no tokenizer.ggml.model)")
        if model != "gpt2":
            raise TokenizerMetadataError(
                f"tokenizer model {model!r} is not supported (byte-level BPE 'gpt2' only)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in GPT2_STYLE_PRE:
            raise TokenizerMetadataError(
                f"pre-tokenizer {pre!r} is not supported; supported: {sorted(GPT2_STYLE_PRE)}")
        tokens = list(meta.get("tokenizer.ggml.tokens") or [])
        merges = list(meta.get("tokenizer.ggml.merges") or [])
        if not tokens or not merges:
            raise TokenizerMetadataError("the file's tokenizer has no tokens or no merges")
        types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerMetadataError(f"{len(types)} token types for {len(tokens)} tokens")

        def token_id(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is None:
                return None
            if not 0 <= int(value) < len(tokens):
                raise TokenizerMetadataError(f"tokenizer.ggml.{key} = {value} is outside the vocabulary")
            return int(value)

        return cls(tokens, [int(t) for t in types], merges, pre, token_id("bos_token_id"),
                   token_id("eos_token_id"), token_id("padding_token_id"), token_id("unknown_token_id"),
                   meta.get("tokenizer.chat_template"))

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.tokens[token_id]


def build_tokenizer(spec: GGUFTokenizerSpec):
    """A ``tokenizers.Tokenizer`` equal in behaviour to the one the GGUF file was made from."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(spec.tokens)}
    merges = []
    for line in spec.merges:
        left, sep, right = line.partition(" ")
        if not sep:
            raise TokenizerMetadataError(f"merge {line!r} is not two tokens separated by a space")
        merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if GPT2_STYLE_PRE[spec.pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                  for tok, kind in zip(spec.tokens, spec.token_types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False)
                          for tok, kind in zip(spec.tokens, spec.token_types) if kind == USER_DEFINED])
    return tokenizer


def tokenizer_config(spec: GGUFTokenizerSpec, max_length: int) -> dict:
    """``tokenizer_config.json``: the special tokens by name and the chat template, as transformers reads them."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": spec.token(spec.bos_token_id),
        "eos_token": spec.token(spec.eos_token_id),
        "pad_token": spec.token(spec.pad_token_id),
        "unk_token": spec.token(spec.unk_token_id),
    }
    if spec.chat_template:
        config["chat_template"] = spec.chat_template
    return {k: v for k, v in config.items() if v is not None}


def write_tokenizer(spec: GGUFTokenizerSpec, out_dir, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir``."""
    from pathlib import Path

    out = Path(out_dir)
    build_tokenizer(spec).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec, max_length), indent=2) + "\n")
