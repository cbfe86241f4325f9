"""Loader and wrappers of the native CPU kernels: paged decode (``csrc/paged_decode_cpu.cpp``), causal
prefill (``csrc/prefill_cpu.cpp``), KV store (``csrc/store_kv_cpu.cpp``) and the fused per-layer steps
(``csrc/fused_cpu.cpp``: residual add + RMSNorm, RoPE + KV store), one extension registering
``torch.ops.kvfleet_kernels.*``.

The extension is compiled with ``torch.utils.cpp_extension.load`` the first time it is needed, in a
directory of the building process's own, and the library is moved into the cache under
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/kvfleet/torch_extensions``) in one rename; later processes
load the cached library in well under a second. Its directory is named after a hash of the sources,
flags and torch version, so checkouts with different kernel sources (worktrees, branches) never
rebuild over one another's cached build, and a process killed mid-build leaves no lock behind.
``KVFLEET_CPU_MARCH`` (deploy/Dockerfile sets it) builds for a named target instead of this machine's.
If compiling fails, ``supports`` answers False and the dispatch falls back to the torch reference;
the reason is logged once.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

from kvfleet.kernels.metadata import AttentionMetadata, AttentionParams, LayerCache
from kvfleet.kernels.reference import prepare_store

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [str(_CSRC / name) for name in ("paged_decode_cpu.cpp", "store_kv_cpu.cpp", "fused_cpu.cpp",
                                            "prefill_cpu.cpp")]
_HEADERS = [str(_CSRC / "vec16.h")]  # not compiled on their own, but a change rebuilds
_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = (*_QUERY_DTYPES, torch.float8_e4m3fn)
_loaded = False
_failed = False


def load_extension() -> bool:
    """Build (first use) or load (cached) the extension; False when it cannot be built (logged once)."""
    global _loaded, _failed
    if _loaded or _failed:
        return _loaded
    error: Exception | None = None
    for name, flags in build_variants():
        try:
            _load_or_build(name, flags)
            _loaded = True
            return True
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the reference"
            error = exc
    _failed = True
    log.warning("native CPU kernels unavailable, using the torch reference: %s", error)
    return False


def _load_or_build(name: str, flags: list[str]) -> None:
    """Load the cached library, else build it once for every process that wants it now: the builder
    holds an ``flock`` on the build's lock file, and the others wait on it and then load what it
    built (two nodes of ``kvfleet up`` starting on a new machine compile once, not twice on the same
    cores). The kernel drops an ``flock`` when its process dies, so a process killed mid-build
    leaves nothing to wait on forever (torch's own lock file would). The build runs in a directory
    of the process's own and moves into the cache in one rename."""
    library = library_path(name, flags)
    if os.path.exists(library):
        torch.ops.load_library(library)
        return
    import fcntl

    os.makedirs(os.path.dirname(library), exist_ok=True)
    with open(os.path.dirname(library) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released at close, or by the kernel when this process dies
        if os.path.exists(library):  # built by another process while this one waited
            torch.ops.load_library(library)
            return
        log.warning("building the native CPU kernels for this CPU (once per machine; ~30 s on 2 cores)")
        _build(name, flags, library)  # cpp_extension.load has loaded it into this process


def _build(name: str, flags: list[str], library: str) -> None:
    """Compile in a private directory and move the library into the cache in one rename."""
    import shutil
    import tempfile

    from torch.utils import cpp_extension

    root = os.path.dirname(os.path.dirname(library))
    _remove_stale_builds(root)
    private = tempfile.mkdtemp(prefix=".building-", dir=root)
    try:
        built = cpp_extension.load(
            name=f"kvfleet_cpu_kernels_{name}",
            sources=_SOURCES,
            extra_cflags=["-O3", "-fopenmp", *flags],
            extra_ldflags=["-fopenmp"],
            build_directory=private,
            is_python_module=False,
            verbose=False,
        )
        os.replace(built, library)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _remove_stale_builds(root: str, older_than_s: float = 3600.0) -> None:
    """Private build directories left by processes killed while building (none runs an hour)."""
    import shutil
    import time

    for entry in Path(root).glob(".building-*"):
        try:
            if time.time() - entry.stat().st_mtime > older_than_s:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            pass


def build_variants() -> list[tuple[str, list[str]]]:
    """The builds to try, best first. ``KVFLEET_CPU_MARCH`` names the one target to build for (an
    image is built on one machine and runs on others, where ``-march=native`` could be an
    instruction they lack); by default this machine's own, then plain -O3 where -march fails."""
    march = os.environ.get("KVFLEET_CPU_MARCH")
    if march:
        return [("march_" + "".join(c if c.isalnum() else "_" for c in march), [f"-march={march}"])]
    return [("native", ["-march=native"]), ("portable", [])]


def library_path(name: str, flags: list[str]) -> str:
    """Where the build of variant ``name`` is cached: named after a hash of the sources, the flags
    and the torch version, so that another checkout, target or torch never loads a stale build."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/kvfleet/torch_extensions")
    key = b"".join(Path(src).read_bytes() for src in _SOURCES + _HEADERS) + " ".join([torch.__version__, *flags]).encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, f"cpu_kernels_{name}_{digest}", f"kvfleet_cpu_kernels_{name}.so")


def supports(query: torch.Tensor, cache: LayerCache) -> bool:
    return (
        query.dtype in _QUERY_DTYPES
        and cache.k.dtype in _CACHE_DTYPES
        and query.shape[2] <= 512
        and (_loaded or load_extension())
    )


_PREFILL_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256)  # csrc/prefill_cpu.cpp's ``built_for``
_PREFILL_DTYPES = (torch.float32, torch.bfloat16)


def supports_prefill(query: torch.Tensor, cache: LayerCache) -> bool:
    """Whether the native causal prefill serves this layer: float32 or bfloat16 query and cache alike
    (bfloat16 rows widened to float32 once per call), a head dim it is built for."""
    return (query.dtype in _PREFILL_DTYPES and cache.k.dtype == query.dtype and query.device.type == "cpu"
            and query.shape[2] in _PREFILL_HEAD_DIMS and (_loaded or load_extension())
            and hasattr(torch.ops.kvfleet_kernels, "causal_prefill_cpu"))


def causal_prefill(query: torch.Tensor, cache: LayerCache, block_table: torch.Tensor, context_len: int,
                   scale: float) -> torch.Tensor:
    """Attention of one sequence's new tokens ``query`` ``[n, H, D]`` (positions ``context_len - n`` on)
    over its keys ``[0, context_len)`` in ``cache`` (``block_table``: its int32 row), causally; no
    window, soft-cap or FP8 (the caller's test)."""
    return torch.ops.kvfleet_kernels.causal_prefill_cpu.default(query, cache.k, cache.v, block_table, context_len,
                                                                scale)


def supports_store(cache: LayerCache) -> bool:
    return cache.k.dtype in _CACHE_DTYPES and (_loaded or load_extension())


def cpu_paged_decode(query: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, params: AttentionParams,
                     num_splits: int = 0) -> torch.Tensor:
    """Native paged decode; same contract as ``reference.paged_decode_reference`` (FP8 rows widened
    times their scales, soft-capped scores when ``params.logit_softcap`` is set).

    The kernel checks layouts itself (this runs once per layer per step, so the Python side stays a
    bare call). ``num_splits`` 0 lets it split long contexts across threads.
    """
    if not _loaded and not load_extension():
        raise RuntimeError("the native CPU kernels could not be built")
    return torch.ops.kvfleet_kernels.paged_decode_cpu.default(
        query, cache.k, cache.v, meta.decode_block_tables, meta.decode_context_lens, params.scale,
        cache.k_scale, cache.v_scale, num_splits, params.window or 0, params.logit_softcap or 0.0,
    )


def cpu_store_kv(key: torch.Tensor, value: torch.Tensor, cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """Native KV store; same contract as ``reference.store_kv_reference``."""
    if not _loaded and not load_extension():
        raise RuntimeError("the native CPU kernels could not be built")
    key, value = prepare_store(key, value, cache, slot_mapping)
    torch.ops.kvfleet_kernels.store_kv_cpu.default(key, value, cache.k, cache.v, slot_mapping)


def supports_fused(x: torch.Tensor) -> bool:
    """Whether the fused per-layer ops serve a model whose activations look like ``x`` (CPU, 16- or
    32-bit floats, the extension built; not under ``KVFLEET_ATTENTION=reference``)."""
    return (x.device.type == "cpu" and x.dtype in _QUERY_DTYPES
            and os.environ.get("KVFLEET_ATTENTION", "").lower() != "reference" and (_loaded or load_extension())
            and hasattr(torch.ops.kvfleet_kernels, "rope_store_cpu"))


def add_rms_norm(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += h`` in place (when ``h`` is given), then ``weight * norm(x)`` as ``RMSNorm`` (offset 0)
    computes it; x and h ``[T, hidden]``."""
    return torch.ops.kvfleet_kernels.add_rms_norm_cpu.default(x, h, weight, eps)


def rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: LayerCache, slot_mapping: torch.Tensor) -> None:
    """q ``[T, H, D]`` turned in place; k turned and v copied into their slots of ``cache`` (of q's
    dtype, not FP8); cos/sin ``[T, D]`` in q's dtype (the whole head turned)."""
    torch.ops.kvfleet_kernels.rope_store_cpu.default(q, k, v, cos, sin, cache.k, cache.v, slot_mapping)
