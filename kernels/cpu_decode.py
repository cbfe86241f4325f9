"""Loader and wrapper of the native CPU decode kernel (``csrc/paged_decode_cpu.cpp``).

The extension is compiled with ``torch.utils.cpp_extension.load`` the first time it is needed and cached
under ``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/kvfleet/torch_extensions``); later processes load the
cached build in well under a second. If compiling fails, ``supports`` answers False and the dispatch
falls back to the torch reference; the reason is logged once.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_loaded = False
_failed = False


def load_extension() -> bool:
    """Build (first use) or load (cached) the extension; False when it cannot be built (logged once)."""
    global _loaded, _failed
    if _loaded or _failed:
        return _loaded
    from torch.utils import cpp_extension

    error: Exception | None = None
    for name, flags in (("native", ["-march=native"]), ("portable", [])):  # plain -O3 where -march fails
        try:
            cpp_extension.load(
                name=f"kvfleet_paged_decode_cpu_{name}",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-fopenmp", *flags],
                extra_ldflags=["-fopenmp"],
                build_directory=_build_dir(name),
                is_python_module=False,
                verbose=False,
            )
            _loaded = True
            return True
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference"
            error = exc
    _failed = True
    log.warning("native CPU paged-decode kernel unavailable, using the torch reference: %s", error)
    return False


def _build_dir(name: str) -> str:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/kvfleet/torch_extensions")
    path = os.path.join(root, f"paged_decode_cpu_{name}")
    os.makedirs(path, exist_ok=True)
    return path


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k_cache.dtype in _DTYPES
        and query.shape[2] <= 512
        and load_extension()
    )


def cpu_paged_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """Native paged decode; same contract as ``reference.paged_decode_reference``.

    ``num_splits`` 0 lets the kernel split long contexts across threads; tests force a number.
    """
    if not _loaded and not load_extension():
        raise RuntimeError("the native CPU paged-decode kernel could not be built")
    # k_cache/v_cache: [num_blocks, num_kv_heads, block_size, head_dim], each (block, head) tile contiguous
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == k_cache.shape[3], "K tiles must be contiguous"
    assert v_cache.stride(3) == 1 and v_cache.stride(2) == v_cache.shape[3], "V tiles must be contiguous"
    assert k_cache.stride() == v_cache.stride()
    num_kv_heads = k_cache.shape[1]
    ones = None
    if k_scale is None or v_scale is None:
        ones = torch.ones(num_kv_heads, dtype=torch.float32)
    return torch.ops.kvfleet_kernels.paged_decode_cpu(
        query.contiguous(),
        k_cache,
        v_cache,
        block_tables.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
        float(scale),
        (k_scale if k_scale is not None else ones).float().contiguous(),
        (v_scale if v_scale is not None else ones).float().contiguous(),
        num_splits,
    )
