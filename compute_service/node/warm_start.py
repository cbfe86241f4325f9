"""How a node starts warm: KV snapshot restore and a random-prefill warm-up before READY, and the
snapshots written while it serves and when it drains (``kvfleet compute`` glue).

    start: restore the snapshot (if any, if it fits) ─▶ warm-up ─▶ [--warmup random: random prefills] ─▶ READY
    serving: every --kv-snapshot-interval-s, a snapshot (skipped when no block changed)
    SIGTERM: requests drained ─▶ a last snapshot ─▶ the engine stops

A snapshot that cannot be restored (kv/snapshot.py says why) costs one log line: the node starts
cold. A snapshot that cannot be written costs one too: the node goes on serving (or exiting).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time

from kvfleet.tenants import WARMUP_TENANT

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_BLOCKS = 128
WARMUP_PROMPTS = 4


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not number >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return number


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-snapshot-dir", default=None,
                        help="directory of this node's KV snapshot (kv-snapshot-<node id>.safetensors): its most "
                             "reused blocks, written on drain and every --kv-snapshot-interval-s, restored at start "
                             "when model, dtypes, block size and hash seed match (default: off)")
    parser.add_argument("--kv-snapshot-interval-s", type=_non_negative_float, default=300.0,
                        help="seconds between snapshots while serving (0: only on drain; default 300)")
    parser.add_argument("--kv-snapshot-blocks", type=_positive_int, default=DEFAULT_SNAPSHOT_BLOCKS,
                        help=f"the most blocks a snapshot holds (default {DEFAULT_SNAPSHOT_BLOCKS})")
    parser.add_argument("--warmup", choices=("minimal", "random"), default="minimal",
                        help="minimal: touch every kernel path before READY (default); random: then also prefill "
                             f"{WARMUP_PROMPTS} random prompts of --warmup-tokens tokens together")
    parser.add_argument("--warmup-tokens", type=_positive_int, default=1024,
                        help="tokens per random warm-up prompt (default 1024, at most max_model_len - 8)")


class WarmStart:
    """One node's snapshots and warm-up. Every engine access goes through ``AsyncEngine.call``,
    so it runs on the engine's thread between steps."""

    def __init__(self, args: argparse.Namespace, async_engine, flush=None):
        self.args = args
        self.engine = async_engine
        self.flush = flush  # a remote allocator's flush: restored commits reach block_service before READY
        self.path = None
        self._fingerprint = None
        self._saved_version = None
        self._periodic: asyncio.Task | None = None
        if args.kv_snapshot_dir:
            from compute_service.kv.snapshot_io import snapshot_path

            self.path = snapshot_path(args.kv_snapshot_dir, args.node_id)

    def _fingerprint_of(self, engine):
        from compute_service.kv.snapshot import Fingerprint, model_digest, seed_digest

        if self._fingerprint is None:
            mc, config = engine.model_config, engine.config
            self._fingerprint = Fingerprint(
                model_digest(self.args.model), config.dtype, engine.kv_cache_dtype, int(config.block_size),
                mc.num_layers, mc.num_kv_heads, mc.head_dim, seed_digest(engine.kv.seed))
        return self._fingerprint

    async def restore(self) -> int:
        """Restore the snapshot into the pool (before READY); the blocks restored (0: cold start)."""
        if self.path is None or not self.path.exists():
            return 0
        from compute_service.kv import snapshot_io as kv_snapshot_io
        from compute_service.kv.snapshot import SnapshotRefused

        started = time.perf_counter()
        fingerprint = await self.engine.call(self._fingerprint_of)
        seed = await self.engine.call(lambda e: e.kv.seed)
        try:
            snap = await asyncio.to_thread(kv_snapshot_io.read, self.path, fingerprint, seed)
            restored = await self.engine.call(lambda e: kv_snapshot_io.restore(
                snap, e.allocator, e.runner.kv_cache, e.runner.kv_scales, e.kv.usage, e.allocator.num_blocks))
        except SnapshotRefused as e:
            log.warning("node %s: KV snapshot %s refused: %s; starting cold", self.args.node_id, self.path, e)
            return 0
        except Exception as e:  # a node never fails to start over its snapshot; what was restored is sound
            log.warning("node %s: KV snapshot %s not restored (%s: %s); starting with what was", self.args.node_id,
                        self.path, type(e).__name__, e)
            return 0
        if self.flush is not None:
            await self.flush()
        self._saved_version = await self.engine.call(lambda e: e.kv.usage.version)
        log.info("node %s: restored %d of the %d blocks of KV snapshot %s in %.2fs", self.args.node_id, restored,
                 snap.num_blocks, self.path, time.perf_counter() - started)
        return restored

    async def random_prefill(self, vocab_size: int, max_model_len: int) -> float:
        """``--warmup random``: prefill random prompts of the size the first requests may have, so
        their shapes' memory and kernels are warm; seconds it took (0 when off)."""
        if self.args.warmup != "random":
            return 0.0
        import random

        from kvfleet.sampling import SamplingParams

        started = time.perf_counter()
        rng = random.Random(0)
        length = max(1, min(self.args.warmup_tokens, max_model_len - 8))
        one = SamplingParams(max_tokens=1, ignore_eos=True)

        async def prefill(i: int) -> None:
            prompt = [rng.randrange(vocab_size) for _ in range(length)]
            async for _ in self.engine.generate(f"warmup-random-{self.args.node_id}-{i}", prompt, one,
                                                tenant=WARMUP_TENANT):
                pass

        await asyncio.gather(*(prefill(i) for i in range(WARMUP_PROMPTS)))
        seconds = time.perf_counter() - started
        log.info("node %s: random-prefill warm-up of %d x %d tokens took %.2fs", self.args.node_id,
                 WARMUP_PROMPTS, length, seconds)
        return seconds

    async def save(self, why: str) -> bool:
        """Write a snapshot of the most reused blocks now; False when there was nothing new to write
        or the write failed (logged: a node never stops over its snapshot)."""
        if self.path is None:
            return False
        from compute_service.kv import snapshot_io as kv_snapshot_io

        started = time.perf_counter()
        limit = self.args.kv_snapshot_blocks

        def take(e):
            version = e.kv.usage.version
            if version == self._saved_version:
                return version, None
            return version, kv_snapshot_io.capture(e.runner.kv_cache, e.runner.kv_scales, e.kv.usage,
                                                   self._fingerprint_of(e), self.args.node_id, limit)

        try:
            version, snap = await self.engine.call(take)
            if snap is None:
                return False
            size = await asyncio.to_thread(kv_snapshot_io.write, self.path, snap)
        except Exception as e:
            log.warning("node %s: KV snapshot (%s) not written: %s", self.args.node_id, why, e)
            return False
        self._saved_version = version
        log.info("node %s: KV snapshot (%s) of %d blocks, %.1f MiB, written to %s in %.2fs", self.args.node_id, why,
                 snap.num_blocks, size / (1 << 20), self.path, time.perf_counter() - started)
        return True

    def start_periodic(self) -> None:
        if self.path is not None and self.args.kv_snapshot_interval_s > 0:
            self._periodic = asyncio.get_running_loop().create_task(self._every(self.args.kv_snapshot_interval_s))

    async def _every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.save("periodic")

    async def on_drain(self) -> None:
        """The requests drained: stop the periodic snapshots, write the last one."""
        if self._periodic is not None:
            self._periodic.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._periodic
        await self.save("drain")


def preflight(args: argparse.Namespace) -> None:
    """A snapshot directory that cannot be one is the person's mistake: said before the model loads."""
    from pathlib import Path

    from kvfleet.preflight import PreflightError

    if args.kv_snapshot_dir and Path(args.kv_snapshot_dir).exists() and not Path(args.kv_snapshot_dir).is_dir():
        raise PreflightError(f"--kv-snapshot-dir {args.kv_snapshot_dir} is not a directory")
