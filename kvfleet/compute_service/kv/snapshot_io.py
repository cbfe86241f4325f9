"""A KV snapshot's file and its way into and out of the pool (torch, safetensors).

    capture (engine thread: a consistent copy) ─▶ write (any thread: checksum, temp file, fsync, rename)
    read (checks: readable, checksum, fingerprint, manifest, shapes) ─▶ restore (engine thread)

The file is one safetensors file: per layer the K and V rows of the snapshot's blocks
(``k.<layer>``, ``v.<layer>``: ``[blocks, kv_heads, block_size, head_dim]`` in the pool's dtype,
with ``k_scale.<layer>``, ``v_scale.<layer>`` ``[blocks, kv_heads, block_size]`` float32 for an FP8
pool), its manifest (kv/snapshot.py) and a SHA-256 over manifest and tensors in its metadata.
Restoring goes through the node's ``BlockAllocator`` like any sequence: one allocation per
root-to-leaf path under the tenant ``__snapshot__``, the fresh blocks written and committed, the
sequence released, so the blocks end cached (committed, unreferenced) at the page table,
in process or at block_service.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfleet.compute_service.kv.block_usage import BlockUsage
from kvfleet.compute_service.kv.chain_import import commit_chain, open_chain
from kvfleet.compute_service.kv.snapshot import (
    Fingerprint,
    Manifest,
    SnapshotRefused,
    rank_blocks,
    restore_paths,
    snapshot_blocks,
)
from kvfleet.core.allocator import BlockAllocator, Refusal

log = logging.getLogger(__name__)

SNAPSHOT_TENANT = "__snapshot__"
_MANIFEST_KEY, _CHECKSUM_KEY = "kvfleet.kv_snapshot", "kvfleet.sha256"


def snapshot_path(directory: str | Path, node_id: str) -> Path:
    """One file per node id, so nodes may share a directory."""
    return Path(directory) / f"kv-snapshot-{re.sub(r'[^A-Za-z0-9._-]', '_', node_id)}.safetensors"


@dataclass(slots=True)
class Snapshot:
    """Blocks and their KV rows: ``kv[:, :, i]`` (``[layers, 2, blocks, kv_heads, block_size,
    head_dim]``, on the CPU) holds ``manifest.blocks[i]``; ``scales`` likewise for FP8 pools."""

    manifest: Manifest
    kv: torch.Tensor
    scales: torch.Tensor | None

    @property
    def num_blocks(self) -> int:
        return len(self.manifest.blocks)


# -- the pool's layout: [layers, 2 (K, V), num_blocks, kv_heads, block_size, head_dim] (kv/pool.py) --

def _rows(pool: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    return pool[:, :, block_ids]


def _write_rows(pool: torch.Tensor, block_ids: torch.Tensor, rows: torch.Tensor) -> None:
    pool[:, :, block_ids] = rows.to(pool.device)


def capture(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, usage: BlockUsage, fingerprint: Fingerprint,
            node_id: str, limit: int) -> Snapshot | None:
    """The ``limit`` most reused blocks, copied out of the pool (on the engine thread, between
    steps: the copy is what the pool held at one moment); None when there is none."""
    ranked = rank_blocks(usage.blocks(), limit)
    if not ranked:
        return None
    ids = torch.tensor([b.block_id for b in ranked], dtype=torch.int64, device=kv_cache.device)
    kv = _rows(kv_cache, ids).to("cpu", copy=True)
    scales = _rows(kv_scales, ids).to("cpu", copy=True) if kv_scales is not None else None
    return Snapshot(Manifest(fingerprint, node_id, snapshot_blocks(ranked)), kv, scales)


def _tensors(snap: Snapshot) -> dict[str, torch.Tensor]:
    tensors = {}
    for layer in range(snap.kv.shape[0]):
        tensors[f"k.{layer}"], tensors[f"v.{layer}"] = snap.kv[layer, 0].contiguous(), snap.kv[layer, 1].contiguous()
        if snap.scales is not None:
            tensors[f"k_scale.{layer}"] = snap.scales[layer, 0].contiguous()
            tensors[f"v_scale.{layer}"] = snap.scales[layer, 1].contiguous()
    return tensors


def _checksum(manifest_json: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(manifest_json.encode())
    for name in sorted(tensors):
        h.update(f"\0{name}\0".encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


def write(path: str | Path, snap: Snapshot) -> int:
    """Write ``snap`` to ``path`` atomically (a temporary file beside it, fsynced, renamed over it,
    the directory fsynced): a reader sees the old file or the new one, never half of one. Returns
    the file's size."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = _tensors(snap)
    manifest = snap.manifest.to_json()
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(temp), metadata={_MANIFEST_KEY: manifest, _CHECKSUM_KEY: _checksum(manifest, tensors)})
        fd = os.open(temp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path.stat().st_size


def read(path: str | Path, fingerprint: Fingerprint, seed: bytes) -> Snapshot:
    """The snapshot at ``path`` if this node may restore it, else ``SnapshotRefused`` (one line):
    unreadable or truncated, a checksum that does not match, another fingerprint, a manifest that
    is not whole, tensors of other shapes than the manifest and fingerprint say."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            text = meta.get(_MANIFEST_KEY)
            if text is None:
                raise SnapshotRefused("it has no kvfleet manifest")
            manifest = Manifest.from_json(text, fingerprint, seed)
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except SnapshotRefused:
        raise
    except Exception as e:  # safetensors' errors for truncated or mangled files, OSError
        raise SnapshotRefused(f"it cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if meta.get(_CHECKSUM_KEY) != _checksum(text, tensors):
        raise SnapshotRefused("its checksum does not match its contents (corrupt)")
    return Snapshot(manifest, *_stack(tensors, manifest))


def _stack(tensors: dict[str, torch.Tensor], manifest: Manifest) -> tuple[torch.Tensor, torch.Tensor | None]:
    fp = manifest.fingerprint
    n = len(manifest.blocks)
    row = (n, fp.num_kv_heads, fp.block_size, fp.head_dim)
    fp8 = fp.kv_cache_dtype == "fp8_e4m3"
    names = {f"{kv}.{layer}" for layer in range(fp.num_layers) for kv in ("k", "v")}
    if fp8:
        names |= {f"{kv}_scale.{layer}" for layer in range(fp.num_layers) for kv in ("k", "v")}
    if set(tensors) != names:
        raise SnapshotRefused("its tensors are not those of its fingerprint's layers")
    for name, t in tensors.items():
        want = row[:3] if "_scale" in name else row
        if tuple(t.shape) != want:
            raise SnapshotRefused(f"its tensor {name} has shape {tuple(t.shape)}, not {want}")
    kv = torch.stack([torch.stack([tensors[f"k.{i}"], tensors[f"v.{i}"]]) for i in range(fp.num_layers)])
    scales = (torch.stack([torch.stack([tensors[f"k_scale.{i}"], tensors[f"v_scale.{i}"]])
                           for i in range(fp.num_layers)]) if fp8 else None)
    return kv, scales


def restore(snap: Snapshot, allocator: BlockAllocator, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
            usage: BlockUsage, limit: int) -> int:
    """Put the first ``limit`` blocks of ``snap`` (a prefix of the manifest: parents first) into
    the pool and have the page table hold them cached; returns how many it holds now. Runs on the
    engine thread before any request. Each block's KV is in the pool before its commit names it,
    so stopping anywhere (the page table refusing: pool full, block_service unreachable; an
    error) leaves only true names behind."""
    if snap.kv.dtype != kv_cache.dtype:
        raise SnapshotRefused(f"its KV is {snap.kv.dtype}, this pool {kv_cache.dtype}")
    blocks = snap.manifest.blocks[:limit]
    held: set[int] = set()  # block ids holding a restored block (one evicted by a later path is written again)
    for n, path in enumerate(restore_paths(blocks)):
        chain = open_chain(allocator, usage, f"kv-snapshot-{n}", SNAPSHOT_TENANT, [blocks[i].block_hash for i in path])
        if isinstance(chain, Refusal):
            log.warning("KV snapshot restore stopped after %d blocks: %s", len(held), chain.message())
            break
        try:
            commit_chain(allocator, usage, chain, [blocks[i] for i in path], len(path),
                         lambda fresh, dst: _write(snap, [path[i] for i in fresh], dst, kv_cache, kv_scales))
        finally:
            allocator.release([chain.seq_id])
        held.update(chain.block_ids[chain.num_cached:])
    return len(held)


def _write(snap: Snapshot, rows: list[int], block_ids: list[int], kv_cache: torch.Tensor,
           kv_scales: torch.Tensor | None) -> None:
    if not rows:
        return
    dst = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    src = torch.tensor(rows, dtype=torch.int64)
    _write_rows(kv_cache, dst, _rows(snap.kv, src))
    if kv_scales is not None and snap.scales is not None:
        _write_rows(kv_scales, dst, _rows(snap.scales, src))
