"""A KV snapshot's pure parts: which blocks go in, what the file must match, and its manifest.

A node with ``--kv-snapshot-dir`` writes its most reused committed blocks on drain and every
``--kv-snapshot-interval-s``; a node starting with a snapshot restores them into its pool before
it turns READY (kv/snapshot_io.py reads and writes the file, warm_start.py is the node's glue).
Bytes restored into a pool are served to requests as if the node had computed them, so a
snapshot is taken only when everything that shaped those bytes is the same here:

    Fingerprint: model (config.json + a sample of the weights), model dtype, KV cache dtype,
                 block size, layers x KV heads x head dim, hash seed, file layout version

and its blocks are taken only when the manifest is whole: every parent before its children, every
hash equal to ``next_block_hash(parent, tokens, extra)`` under this cluster's seed. Anything else
is ``SnapshotRefused``, one line, and the node starts cold.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from kvfleet.compute_service.kv.block_usage import CommittedBlock
from kvfleet.core.block_hash import HASH_BYTES, next_block_hash

LAYOUT_VERSION = 1  # the file: tensors k.<layer>, v.<layer> [blocks, kv_heads, block_size, head_dim] (+ *_scale)
_WEIGHTS_SAMPLE = 1 << 20  # bytes read from each end of each weights file for the model's digest


class SnapshotRefused(Exception):
    """A snapshot this node must not restore; ``str()`` is one line saying why."""


def model_digest(model_dir: str | Path) -> str:
    """A digest of what makes a model's KV: its config.json, and each weights file's name, size and
    first and last MiB (two models of one config but other weights differ there; reading all of a
    large model's weights at every start would cost more than the snapshot saves)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"\0{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(_WEIGHTS_SAMPLE))
            f.seek(max(0, size - _WEIGHTS_SAMPLE))
            h.update(f.read(_WEIGHTS_SAMPLE))
    return h.hexdigest()[:32]


def seed_digest(seed: bytes) -> str:
    """The cluster's hash seed, named without being revealed."""
    return hashlib.sha256(b"kvfleet-seed\0" + seed).hexdigest()[:16]


def first_difference(mine: object, theirs: object, there: str) -> str | None:
    """The first field in which two dataclasses of one kind differ, as ``"block_size 32 here, 16
    <there>"``; None when they are equal."""
    for f in fields(mine):
        a, b = getattr(mine, f.name), getattr(theirs, f.name)
        if a != b:
            return f"{f.name} {a} here, {b} {there}"
    return None


@dataclass(slots=True, frozen=True)
class Fingerprint:
    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_seed: str
    layout: int = LAYOUT_VERSION

    def mismatch(self, snapshot: Fingerprint) -> str | None:
        """The first difference, as ``"block_size 32 here, 16 in the snapshot"``; None when equal."""
        return first_difference(self, snapshot, "in the snapshot")

    @classmethod
    def from_dict(cls, d: object) -> Fingerprint:
        if not isinstance(d, dict) or set(d) != {f.name for f in fields(cls)}:
            raise SnapshotRefused("its fingerprint is malformed")
        fp = cls(**d)
        for f in fields(cls):
            if not isinstance(getattr(fp, f.name), int if f.type == "int" else str):
                raise SnapshotRefused(f"its fingerprint's {f.name} is malformed")
        return fp


@dataclass(slots=True, frozen=True)
class SnapshotBlock:
    """One block in the file, at row ``i`` of its tensors when it is ``blocks[i]`` of the manifest."""

    block_hash: bytes
    parent_hash: bytes          # b"": a sequence's first block
    token_ids: tuple[int, ...]  # block_size of them: the hash is checked against them
    extra: bytes                # the first block's extra key (its tenant, unless prefixes are shared)
    hits: int                   # prefix hits when it was taken (the restored node ranks by them too)


@dataclass(slots=True)
class Manifest:
    """What the file says about its tensors; ``blocks`` parents first (any prefix is restorable)."""

    fingerprint: Fingerprint
    node_id: str
    blocks: list[SnapshotBlock]

    def to_json(self) -> str:
        return json.dumps({
            "fingerprint": asdict(self.fingerprint), "node_id": self.node_id,
            "blocks": [[b.block_hash.hex(), b.parent_hash.hex(), list(b.token_ids), b.extra.hex(), b.hits]
                       for b in self.blocks],
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, expected: Fingerprint, seed: bytes) -> Manifest:
        """The manifest of a snapshot this node may restore: its fingerprint equal to ``expected``,
        its blocks whole (``check_blocks``); ``SnapshotRefused`` otherwise."""
        try:
            d = json.loads(text)
            fingerprint = Fingerprint.from_dict(d["fingerprint"])
            mismatch = expected.mismatch(fingerprint)
            if mismatch is not None:
                raise SnapshotRefused(f"it was taken with another configuration: {mismatch}")
            blocks = [SnapshotBlock(bytes.fromhex(h), bytes.fromhex(p), tuple(t), bytes.fromhex(e), int(n))
                      for h, p, t, e, n in d["blocks"]]
            node_id = str(d["node_id"])
        except SnapshotRefused:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise SnapshotRefused(f"its manifest is malformed ({type(e).__name__}: {e})") from None
        manifest = cls(fingerprint, node_id, blocks)
        manifest.check_blocks(seed)
        return manifest

    def check_blocks(self, seed: bytes) -> None:
        """Every block full, named by its content (hash = H(parent, tokens, extra) under ``seed``),
        once, after its parent: what the pool would hold had this node computed it."""
        seen: set[bytes] = set()
        bs = self.fingerprint.block_size
        for i, b in enumerate(self.blocks):
            if len(b.block_hash) != HASH_BYTES or len(b.token_ids) != bs or b.hits < 0:
                raise SnapshotRefused(f"its block {i} is malformed")
            if not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in b.token_ids):
                raise SnapshotRefused(f"its block {i} has a token id out of range")
            if b.parent_hash and b.parent_hash not in seen:
                raise SnapshotRefused(f"its block {i} comes before its parent")
            if b.block_hash in seen:
                raise SnapshotRefused(f"its block {i} is listed twice")
            if next_block_hash(b.parent_hash, b.token_ids, b.extra, seed) != b.block_hash:
                raise SnapshotRefused(f"its block {i}'s hash does not name its tokens (another hash seed?)")
            seen.add(b.block_hash)


def rank_blocks(blocks: Iterable[CommittedBlock], limit: int) -> list[CommittedBlock]:
    """At most ``limit`` blocks worth restoring: the most reused first (prefix hits, then recency),
    each brought in with its ancestors, parents before children. A block whose parent the node no
    longer holds is left out (a prefix lookup could never reach it); so is one whose missing
    ancestors do not fit. Of two blocks with one hash, the more reused one is kept.

        a(5) ─ b(5) ─ c(1)        limit 3: a, b, then d needs its parent e first: a, b, e would
        e(0) ─ d(4)               not hold d (4 blocks), so c: [a, b, c]
    """
    by_hash: dict[bytes, CommittedBlock] = {}
    for b in blocks:
        kept = by_hash.get(b.block_hash)
        if kept is None or (b.hits, b.last_used) > (kept.hits, kept.last_used):
            by_hash[b.block_hash] = b
    order = sorted(by_hash.values(), key=lambda b: (-b.hits, -b.last_used))
    chosen: dict[bytes, CommittedBlock] = {}
    for block in order:
        if len(chosen) >= limit:
            break
        chain = _missing_chain(block, by_hash, chosen)
        if chain is not None and len(chosen) + len(chain) <= limit:
            chosen.update((b.block_hash, b) for b in chain)
    return list(chosen.values())


def _missing_chain(block: CommittedBlock, by_hash: dict[bytes, CommittedBlock],
                   chosen: dict[bytes, CommittedBlock]) -> list[CommittedBlock] | None:
    """``block`` and its ancestors not yet chosen, root first; None when an ancestor is not held."""
    chain = []
    while block.block_hash not in chosen:
        chain.append(block)
        if not block.parent_hash:
            break
        parent = by_hash.get(block.parent_hash)
        if parent is None:
            return None
        block = parent
    return chain[::-1]


def snapshot_blocks(ranked: Iterable[CommittedBlock]) -> list[SnapshotBlock]:
    return [SnapshotBlock(b.block_hash, b.parent_hash, b.token_ids, b.extra, b.hits) for b in ranked]


def restore_paths(blocks: list[SnapshotBlock]) -> list[list[int]]:
    """The manifest's blocks (indexes, parents first) as root-to-leaf paths, one allocation each:
    a path's leading blocks restored by an earlier path come back as prefix hits.

        0 ─ 1 ─ 2         [[0, 1, 2], [0, 3]]
          └ 3
    """
    index = {b.block_hash: i for i, b in enumerate(blocks)}
    parent_of = [index[b.parent_hash] if b.parent_hash else None for b in blocks]
    has_child = {p for p in parent_of if p is not None}
    paths = []
    for leaf in range(len(blocks)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node is not None:
            path.append(node)
            node = parent_of[node]
        paths.append(path[::-1])
    return paths
