"""FP8 KV caches store each key minus a constant vector per (layer, KV head): exact, free, and
smaller keys lose less to e4m3's 3-bit mantissa.

Why it is exact: a query's attention logits over its keys are ``q . k_t``; storing ``k_t - c`` (the
same ``c`` for every key of the layer and KV head) shifts each of that query's logits by the same
``-q . c``, and softmax ignores a shift common to all its inputs. Nothing else changes: no kernel,
no byte of the pool, no weight; the attention paths (reference, native CPU, Triton) read the stored
keys as they always did. A float32 pool gives the same logits with or without centres (to rounding).

Why it helps FP8 and scaling does not: e4m3 rounds every element to 3 mantissa bits whatever its
magnitude, so per-channel smoothing (dividing K by ``s`` and multiplying q by it) leaves each
product ``q_c k_c`` with the same relative error: measured, it changes nothing (bench/fp8_accuracy.py,
BENCHMARKS.md). Subtracting a common offset does change the values: channels that carry a large
constant (this model's slow RoPE pairs) shrink, and so does their absolute rounding error.

The centre is the mean post-RoPE key of a fixed calibration text, averaged over every position the
engine serves (``max_positions``): a RoPE pair that rotates within that range averages towards 0
(left uncentred, it would be wrong at far positions), a pair that barely rotates keeps its offset.
Centres are rounded to bfloat16 values so that nodes of the same model agree on them to the bit
wherever their float32 forward passes differ in the last places (keys in block_service move
between nodes). Values are stored only for FP8 pools; other dtypes are untouched.
"""

from __future__ import annotations

import torch

from compute_service.attention_metadata import AttentionMetadata
from compute_service.model import CausalLM
from compute_service.rope import inverse_frequencies

# Plain English running text, fixed: the centres depend on the model alone, never on the traffic.
CALIBRATION_TEXT = (
    "The river rose quickly after three days of heavy rain in the mountains, and the village council met "
    "in the old school to decide what to do. Some wanted to build a wall of sandbags along the bank; others "
    "said the water would go down by itself, as it always had. A young engineer showed them a map of the "
    "valley and explained, step by step, where the flood would reach if the rain went on for one more day. "
    "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n"
    "In 1969 two astronauts walked on the surface of the Moon. Prime numbers have exactly two divisors: "
    "one and the number itself. To reset the router, hold the button on the back for ten seconds. "
    "The library will be closed on Monday for the installation of new shelves, and reopens on Tuesday at nine."
)
CALIBRATION_BLOCK = 16
POSITION_SAMPLES = 4096  # positions the rotation average samples, evenly spread over the served range


def rotation_average(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cos and sin ``[head_dim / 2]`` of each RoPE pair's angle over positions ``[0, max_positions)``
    (sampled evenly): what a pair's offset keeps once averaged over every position it may sit at."""
    step = max(1, max_positions // POSITION_SAMPLES)
    angles = torch.arange(0, max_positions, step, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    return angles.cos().mean(0).float(), angles.sin().mean(0).float()


def spread(mean_key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``mean_key [..., head_dim]`` (post-RoPE, pairs ``i, i + head_dim/2``) rotated by each pair's
    average rotation, as ``apply_rope`` rotates: ``(x1, x2) -> (c x1 - s x2, s x1 + c x2)``."""
    half = mean_key.shape[-1] // 2
    x1, x2 = mean_key[..., :half], mean_key[..., half:]
    return torch.cat([cos * x1 - sin * x2, sin * x1 + cos * x2], dim=-1)


@torch.inference_mode()
def mean_keys(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """Mean post-RoPE key ``[layers, kv_heads, head_dim]`` (float32) of ``token_ids`` prefilled at
    positions ``0..n-1`` over a small pool of the model's own dtype."""
    cfg = model.config
    weight = model.embed_tokens.weight
    n = len(token_ids)
    blocks = -(-n // CALIBRATION_BLOCK)
    pool = torch.zeros(cfg.num_layers, 2, blocks, cfg.num_kv_heads, CALIBRATION_BLOCK, cfg.head_dim,
                       dtype=weight.dtype, device=weight.device)
    device = weight.device
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device), num_prefill_tokens=n,
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        prefill_context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        decode_block_tables=torch.zeros(0, 0, dtype=torch.int32, device=device),
        decode_context_lens=torch.zeros(0, dtype=torch.int32, device=device), scale=cfg.head_dim ** -0.5)
    model(torch.tensor(token_ids, device=device), torch.arange(n, device=device), pool, meta,
          torch.tensor([n - 1], device=device))
    # pool[:, 0]: [layers, blocks, kv_heads, block, head_dim] -> the first n slots of each head
    keys = pool[:, 0].float().permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :n]
    return keys.mean(dim=2)


def key_centers(model: CausalLM, token_ids: list[int], max_positions: int) -> torch.Tensor:
    """The centres ``[layers, kv_heads, head_dim]`` (float32 holding bfloat16 values) for a model
    serving positions ``[0, max_positions)``, calibrated on ``token_ids``."""
    cfg = model.config
    inv_freq, _scale = inverse_frequencies(cfg.head_dim, cfg.rope)
    cos, sin = rotation_average(inv_freq, max_positions)
    mean = mean_keys(model, token_ids)
    return spread(mean, cos.to(mean.device), sin.to(mean.device)).bfloat16().float()


def set_key_centers(model: CausalLM, centers: torch.Tensor | None) -> None:
    """Every attention layer stores keys minus its ``centers[layer]`` (None: plain keys again)."""
    for i, layer in enumerate(model.layers):
        layer.self_attn.k_center = None if centers is None else centers[i]
