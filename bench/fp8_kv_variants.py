"""What could lift FP8 KV's top-1 agreement: exact transforms and other codes, emulated.

``bench/fp8_accuracy.py`` measures the FP8 pool the engine serves; this one asks which change to
it would be worth building, without building it. The model (SmolLM2-135M-Instruct, float32) runs
with dense causal attention over K and V that went through a variant's store-and-read-back
(quantise, dequantise), teacher-forced against the same forward with exact K and V:

    bfloat16       K and V rounded to bfloat16: the 16-bit baseline
    fp8            e4m3 with one scale per (token, KV head): what the pool stores
    smooth_k       K / s before FP8 and q * s (exact fold), s per (layer, KV head, RoPE pair): the
                   RMS of the calibration keys, equal on both channels of a pair
    smooth_v       V / s before FP8, s into o_proj's columns (exact fold), s per channel: RMS
    center_k       K minus its mean post-RoPE key c per (layer, KV head): exact (each query's
                   logits all move by -q.c, softmax ignores it), c over positions 0..positions-1
    center_k_long  the same c averaged over the model's max_position_embeddings (pairs that turn
                   there cancel): the centre an engine serving long contexts would have to use
    center_v       V minus its mean c, c added back after attention (the weights sum to 1): exact
    sinks_exact    the first 4 tokens' K and V kept exact
    layer0_exact   layer 0's K and V kept exact (16-bit), FP8 elsewhere
    int8           not FP8: a uniform 8-bit code, one scale per (token, KV head), for reference

Calibration statistics come from the other corpus than the one measured (4 prompts), so nothing
is fitted to the measured text. ``--json``: one object, ``{variant: {top1_agreement, mean_kl}}``.

    python bench/fp8_kv_variants.py [--quick] [--json] [--corpus docs|shuffled] [--prompts N]
                                    [--variants a,b,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import add_smoke_flag, model_dir_or_none  # noqa: E402
from bench.plan_vs_measured import cpu_model  # noqa: E402
from bench.prose_corpus import CORPORA  # noqa: E402

FULL = dict(prompts=8, positions=256)
QUICK = dict(prompts=4, positions=128)
SMOKE = dict(prompts=1, positions=32)
CALIBRATION_PROMPTS = 4
BATCH = 4  # prompts per forward


def build(model_dir: Path):
    """The model, its config, and ``forward(ids [B, T], k_fn, v_fn, capture)``: log-probabilities
    ``[B, T, vocab]`` with ``k_fn(layer, k)`` / ``v_fn(layer, v)`` applied to K/V ``[B, Hkv, T, D]``
    (post-RoPE) before attention; ``capture(layer, q, k, v)`` sees them first."""
    import torch
    import torch.nn.functional as F

    from kvfleet.compute_service.model.config import ModelConfig
    from kvfleet.compute_service.model.rope import apply_rope, inverse_frequencies
    from kvfleet.compute_service.model.weights import load_model

    mc = ModelConfig.from_dir(model_dir)
    model = load_model(model_dir, mc, torch.float32, torch.device("cpu")).eval()
    inv_freq, rope_scale = inverse_frequencies(mc.head_dim, mc.rope)
    heads, kv_heads, dim = mc.num_heads, mc.num_kv_heads, mc.head_dim

    @torch.inference_mode()
    def forward(ids, k_fn=None, v_fn=None, capture=None):
        batch, length = ids.shape
        x = model.embed_tokens(ids)
        angles = torch.arange(length).float()[:, None] * inv_freq[None]
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos()[:, None] * rope_scale, angles.sin()[:, None] * rope_scale
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            q, k, v = attn.qkv_proj(layer.input_layernorm(x)).split(attn.split, -1)
            q, k = apply_rope(q.view(batch, length, heads, dim), k.view(batch, length, kv_heads, dim), cos, sin)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(batch, length, kv_heads, dim).transpose(1, 2)
            if capture is not None:
                capture(i, q, k, v)
            k = k_fn(i, k) if k_fn else k
            v = v_fn(i, v) if v_fn else v
            k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, length, heads * dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return torch.log_softmax(model.lm_head(model.norm(x)).float(), -1)

    return model, mc, forward


def fp8_rows(x):
    """e4m3 with one scale per last-dimension row (``amax / 448``), read back as float32."""
    import torch

    fmax = torch.finfo(torch.float8_e4m3fn).max
    scale = (x.abs().amax(-1, keepdim=True) / fmax).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).float() * scale


def int8_rows(x):
    import torch

    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return (x / scale).round().clamp(-127, 127) * scale


def calibrate(forward, ids) -> dict[int, dict]:
    """Per layer: mean and RMS over the calibration tokens of K and V ``[Hkv, D]`` (post-RoPE K)."""
    stats: dict[int, dict] = {}

    def capture(layer, _q, k, v):
        k, v = (t.transpose(0, 1).flatten(1, 2) for t in (k, v))  # [Hkv, B * T, D]
        stats[layer] = dict(k_mean=k.mean(1), v_mean=v.mean(1), k_rms=k.pow(2).mean(1).sqrt(),
                            v_rms=v.pow(2).mean(1).sqrt())

    forward(ids, capture=capture)
    return stats


def variants(stats: dict, mc) -> dict:
    """name -> (k_fn, v_fn), each ``(layer, x [B, Hkv, T, D]) -> x`` as read back from the cache."""
    import torch

    from kvfleet.compute_service.model.rope import inverse_frequencies

    half = mc.head_dim // 2
    inv_freq, _ = inverse_frequencies(mc.head_dim, mc.rope)
    angles = torch.arange(mc.max_position_embeddings).double()[:, None] * inv_freq.double()[None]
    c, s = angles.cos().mean(0).float(), angles.sin().mean(0).float()

    def long_centre(m):  # the mean key, each pair rotated by its average rotation over the positions
        return torch.cat([c * m[..., :half] - s * m[..., half:], s * m[..., :half] + c * m[..., half:]], -1)

    def pairwise(rms):  # equal on both channels of a RoPE pair, so that the fold commutes with RoPE
        top = torch.maximum(rms[..., :half], rms[..., half:])
        return torch.cat([top, top], -1).clamp(min=1e-6)

    def smoothed(key, pair):
        def read(layer, x):
            scale = stats[layer][key]
            scale = (pairwise(scale) if pair else scale.clamp(min=1e-6))[None, :, None, :]
            return fp8_rows(x / scale) * scale
        return read

    def centred(centres):
        def read(layer, x):
            centre = centres[layer][None, :, None, :]
            return fp8_rows(x - centre) + centre
        return read

    def fp8(_layer, x):
        return fp8_rows(x)

    def sinks(_layer, x, keep=4):
        return torch.cat([x[:, :, :keep], fp8_rows(x[:, :, keep:])], 2)

    def layer0(layer, x):
        return x if layer == 0 else fp8_rows(x)

    k_means = {layer: st["k_mean"] for layer, st in stats.items()}
    def bf16(_layer, x):
        return x.bfloat16().float()

    return {
        "bfloat16": (bf16, bf16),
        "fp8": (fp8, fp8),
        "smooth_k": (smoothed("k_rms", True), fp8),
        "smooth_v": (fp8, smoothed("v_rms", False)),
        "center_k": (centred(k_means), fp8),
        "center_k_long": (centred({layer: long_centre(m) for layer, m in k_means.items()}), fp8),
        "center_v": (fp8, centred({layer: st["v_mean"] for layer, st in stats.items()})),
        "sinks_exact": (sinks, sinks),
        "layer0_exact": (layer0, layer0),
        "int8": (lambda _layer, x: int8_rows(x), lambda _layer, x: int8_rows(x)),
    }


def run(model_dir: Path, corpus: str, num_prompts: int, positions: int, names: list[str] | None) -> dict:
    import torch

    from kvfleet.compute_service.model.tokenizer import Tokenizer

    model, mc, forward = build(model_dir)
    tokenizer = Tokenizer(model_dir)
    ids = torch.tensor(CORPORA[corpus](tokenizer, num_prompts, positions))
    other = "shuffled" if corpus == "docs" else "docs"
    table = variants(calibrate(forward, torch.tensor(CORPORA[other](tokenizer, CALIBRATION_PROMPTS, positions))), mc)
    unknown = sorted(set(names or ()) - set(table))
    if unknown:
        raise SystemExit(f"fp8_kv_variants: unknown variant(s) {', '.join(unknown)}; known: {', '.join(table)}")
    chosen = names or list(table)
    tally = {name: [0, 0.0] for name in chosen}
    started = time.perf_counter()
    for i in range(0, num_prompts, BATCH):
        batch = ids[i:i + BATCH]
        ref = forward(batch)
        for name in chosen:
            got = forward(batch, *table[name])
            tally[name][0] += int((got.argmax(-1) == ref.argmax(-1)).sum())
            tally[name][1] += float((ref.exp() * (ref - got)).sum())
    compared = num_prompts * positions
    return {"model": model_dir.name, "corpus": corpus, "calibration_corpus": other, "prompts": num_prompts,
            "positions": positions, "compared_positions": compared, "cpu": cpu_model(),
            "seconds": round(time.perf_counter() - started, 1),
            "variants": {name: {"top1_agreement": agree / compared, "mean_kl": kl / compared}
                         for name, (agree, kl) in tally.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts x 128 positions (default 8 x 256)")
    parser.add_argument("--json", action="store_true", help="one JSON object on the last line")
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="docs")
    parser.add_argument("--model", default=None, help="model directory (default: the pulled SmolLM2)")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--variants", default=None, help="comma-separated subset (default: all)")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.prompts is not None and args.prompts < 1:
        print(f"fp8_kv_variants: --prompts must be at least 1, got {args.prompts}", file=sys.stderr)
        return 2
    model_dir = model_dir_or_none(args.model, "fp8_kv_variants")
    if model_dir is None:
        return 2
    names = [n for n in args.variants.split(",") if n] if args.variants else None
    shape = SMOKE if args.smoke else QUICK if args.quick else FULL
    result = run(model_dir, args.corpus, args.prompts or shape["prompts"], shape["positions"], names)
    print(f"{result['model']}, corpus {result['corpus']} (calibrated on {result['calibration_corpus']}): "
          f"{result['prompts']} prompts x {result['positions']} positions, teacher-forced against exact K/V, "
          f"{result['cpu']}, {result['seconds']} s")
    print("| variant | top-1 agreement | mean KL (nats) |\n|---|---|---|")
    for name, r in result["variants"].items():
        print(f"| {name} | {r['top1_agreement']:.2%} | {r['mean_kl']:.2e} |")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
