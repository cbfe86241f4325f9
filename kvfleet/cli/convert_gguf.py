"""``kvfleet convert-gguf FILE --out DIR``: a GGUF file to a Hugging Face model directory that
kvfleet (and transformers) load: ``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``generation_config.json``.

The light route: the ``gguf`` package dequantizes each tensor to float32 and llama.cpp's row
permutation of q and k is undone (llama.cpp interleaves each head's two RoPE halves; kvfleet and
transformers rotate the halves as they are). The weights are written in float32: a Q4_1/Q8_0 value
is ``scale * q + min`` with float16 scale and min, exact in float32 but not in bfloat16, so a node
run with ``--dtype float32`` serves what transformers computes with (``auto``, the default, casts
them to bfloat16 at load on a CPU with native bfloat16).

The directory is written into a temporary folder beside ``DIR`` and renamed at the end: a file that
is missing, truncated or of an architecture not supported leaves nothing behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from kvfleet.cli.gguf_tokenizer import GGUFTokenizerSpec, TokenizerMetadataError, write_tokenizer
from kvfleet.compute_service.model.config import ModelConfig, ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class ConvertError(Exception):
    """A GGUF file this converter cannot turn into a model directory; the message is one line."""


def llama_config(meta: dict, tok: GGUFTokenizerSpec, tied: bool) -> dict:
    """``config.json`` from the file's ``llama.*`` metadata."""
    import numpy as np

    def need(key: str):
        if f"llama.{key}" not in meta:
            raise ConvertError(f"metadata llama.{key} is missing")
        return meta[f"llama.{key}"]

    if meta.get("llama.rope.scaling.type", "none") != "none":
        raise ConvertError(f"rope scaling {meta['llama.rope.scaling.type']!r} is not supported")
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta.get("llama.vocab_size", len(tok.tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        # GGUF stores float32: written the way a person wrote it (1e-05, not 9.99...e-06)
        "rms_norm_eps": float(str(np.float32(need("attention.layer_norm_rms_epsilon")))),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "torch_dtype": "float32",
    }


def checked(config: dict) -> ModelConfig:
    """The engine's own validation of ``config.json``, before anything is written."""
    try:
        return ModelConfig.from_dict(config, source="the GGUF metadata")
    except ModelLoadError as exc:
        raise ConvertError(str(exc)) from None


def expected_shape(c: ModelConfig, hf_name: str) -> tuple[int, ...]:
    """The Hugging Face shape of ``hf_name`` (rows = output features)."""
    h, q, kv, inter = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    suffix = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    return {
        "model.embed_tokens.weight": (c.vocab_size, h), "lm_head.weight": (c.vocab_size, h),
        "model.norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }[suffix]


def unpermute_rope_rows(weights, num_heads: int):
    """Undo llama.cpp's ``permute`` of a q or k projection: per head, its rows were reordered from
    [first half | second half] to interleaved pairs (x0, x_{d/2}, x1, x_{d/2+1}, ...).

        llama.cpp row r = head * d + 2 * i + half   ←   HF row  head * d + half * d/2 + i
    """
    rows = weights.shape[0]
    half = rows // num_heads // 2
    return weights.reshape(num_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in TOP_TENSORS:
        return TOP_TENSORS[gguf_name]
    head, _, rest = gguf_name.partition(".")
    if head == "blk":
        index, _, tail = rest.partition(".")
        if index.isdigit() and tail in LAYER_TENSORS:
            return f"model.layers.{index}.{LAYER_TENSORS[tail]}"
    return None


def read_gguf(path: Path):
    """The reader and its metadata as plain Python values; every way a file can be unreadable is a ConvertError."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise ConvertError("the 'gguf' package is missing: pip install 'kvfleet[convert]'") from None
    if not path.is_file():
        raise ConvertError(f"{path}: no such file")
    try:
        reader = GGUFReader(str(path))
        meta = {name: field.contents() for name, field in reader.fields.items()}
    except Exception as exc:  # gguf raises ValueError, IndexError, struct errors ... on a damaged file
        raise ConvertError(f"{path} is not a readable GGUF file (truncated or damaged?): {exc}") from None
    return reader, meta


def dequantized_tensors(reader, mc: ModelConfig) -> dict:
    """Hugging Face name -> float32 numpy array, q and k un-permuted, every shape checked."""
    import numpy as np
    from gguf import dequantize

    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ConvertError(f"tensor {tensor.name!r} is not a Llama tensor this converter knows")
        try:
            weights = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except Exception as exc:  # an unknown quantization type, a short buffer
            raise ConvertError(f"tensor {tensor.name!r} ({tensor.tensor_type.name}) cannot be dequantized: {exc}") from None
        if tuple(weights.shape) != expected_shape(mc, name):
            raise ConvertError(f"tensor {tensor.name!r} has shape {tuple(weights.shape)}, "
                               f"expected {expected_shape(mc, name)}")
        if name.endswith("q_proj.weight"):
            weights = unpermute_rope_rows(weights, mc.num_heads)
        elif name.endswith("k_proj.weight"):
            weights = unpermute_rope_rows(weights, mc.num_kv_heads)
        tensors[name] = np.ascontiguousarray(weights)
    required = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{suffix}" for i in range(mc.num_layers) for suffix in LAYER_TENSORS.values()}
    missing = sorted(required - tensors.keys())
    if missing:
        raise ConvertError(f"{len(missing)} tensors are missing, e.g. {missing[0]!r}")
    return tensors


def generation_config(tok: GGUFTokenizerSpec) -> dict:
    return {k: v for k, v in {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                              "pad_token_id": tok.pad_token_id}.items() if v is not None}


def convert(gguf_path: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write the model directory ``out_dir`` from ``gguf_path``; all or nothing."""
    from safetensors.numpy import save_file

    gguf_path, out = Path(gguf_path), Path(out_dir)
    if out.exists() and not force:
        raise ConvertError(f"{out} already exists (--force replaces it)")
    reader, meta = read_gguf(gguf_path)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConvertError(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    try:
        tok = GGUFTokenizerSpec.from_metadata(meta)
    except TokenizerMetadataError as exc:
        raise ConvertError(str(exc)) from None
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    config = llama_config(meta, tok, tied)
    mc = checked(config)
    tensors = dequantized_tensors(reader, mc)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.converting-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors writes 0600; the directory is shared like any model
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(tok), indent=2) + "\n")
        write_tokenizer(tok, tmp, mc.max_position_embeddings)
        if out.exists():  # --force: the old directory goes only once the new one is complete
            old = out.parent / f".{out.name}.replaced-{os.getpid()}"
            out.rename(old)
            shutil.rmtree(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="GGUF file (Llama architecture, byte-level BPE tokenizer)")
    parser.add_argument("--out", required=True, help="model directory to write (must not exist)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")


def run(args: argparse.Namespace) -> int:
    try:
        out = convert(args.file, args.out, args.force)
    except (ConvertError, OSError) as exc:
        print(f"kvfleet convert-gguf: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out} (config.json, model.safetensors float32, tokenizer.json, tokenizer_config.json, "
          "generation_config.json)")
    return 0
