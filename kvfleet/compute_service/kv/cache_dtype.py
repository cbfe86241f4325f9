"""The KV cache's dtype: the names ``--kv-cache-dtype`` takes (vLLM's, where they overlap) and what a
token costs in each. Pure: the command line validates here without importing torch.

    bytes per token = 2 (K, V) x layers x kv_heads x (head_dim x element bytes + scale bytes)

``fp8_e4m3`` stores ``float8_e4m3fn`` elements plus one float32 scale per token and KV head (see
``kvfleet/kernels/reference.py``): at head_dim 64 that is 68 bytes per head-row against 128 in bfloat16.
``auto`` is the model's own dtype (``--dtype``).
"""

from __future__ import annotations

ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1}
SCALE_BYTES = {"fp8_e4m3": 4}  # one float32 per (token, KV head) row; 0 for the others
KV_CACHE_DTYPES = ("auto", *ELEMENT_BYTES)


def resolve_kv_cache_dtype(name: str, model_dtype: str) -> str:
    """The concrete dtype name for ``name`` (``auto``: ``model_dtype``); ``ValueError`` in one line
    for a name that is not one of ``KV_CACHE_DTYPES``."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    return model_dtype if name == "auto" else name


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes one token's K and V take in the pool, scales included (``kv_dtype`` resolved)."""
    row = head_dim * ELEMENT_BYTES[kv_dtype] + SCALE_BYTES.get(kv_dtype, 0)
    return 2 * num_layers * num_kv_heads * row


def fp8_unsupported_reason(has_float8: bool, device_type: str, capability: tuple[int, int] | None) -> str | None:
    """Why FP8 KV cannot run here (None: it can). CPU kernels widen FP8 in software and need only a
    torch with ``float8_e4m3fn``; the Triton kernels load ``float8e4nv`` tiles, which NVIDIA GPUs
    have from compute capability 8.9 (Ada, Hopper) on."""
    if not has_float8:
        return "this torch has no float8_e4m3fn dtype; upgrade torch (2.1+) or pick another --kv-cache-dtype"
    if device_type == "cuda" and capability is not None and capability < (8, 9):
        return (f"--kv-cache-dtype fp8_e4m3 needs a GPU of compute capability 8.9 or later (Ada, Hopper), "
                f"this one is {capability[0]}.{capability[1]}; pick bfloat16")
    return None
