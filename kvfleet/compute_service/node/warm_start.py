"""How a node starts warm: KV snapshot restore and a random-prefill warm-up before READY, and the
snapshots written while it serves and when it drains (``kvfleet compute`` glue).

    start: restore the snapshot (if any, if it fits) ─▶ warm-up ─▶ [--warmup random: random prefills] ─▶ READY
    serving: every --kv-snapshot-interval-s, a snapshot (skipped when no block changed)
    SIGTERM: requests drained ─▶ a last snapshot ─▶ the engine stops

A snapshot that cannot be restored (kv/snapshot.py says why) costs one log line: the node starts
cold. A snapshot that cannot be written costs one too: the node goes on serving (or exiting).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kvfleet.compute_service.node.settings import WARMUP_PROMPTS, WarmStartSettings
from kvfleet.core.tenants import WARMUP_TENANT

log = logging.getLogger(__name__)


class WarmStart:
    """One node's snapshots and warm-up. Every engine access goes through ``AsyncEngine.call``,
    so it runs on the engine's thread between steps."""

    def __init__(self, settings: WarmStartSettings, node_id: str, model: str, async_engine, flush=None):
        self.settings = settings
        self.node_id = node_id
        self.model = model
        self.engine = async_engine
        self.flush = flush  # a remote allocator's flush: restored commits reach block_service before READY
        self.path = None
        self._fingerprint = None
        self._saved_version = None
        self._periodic: asyncio.Task | None = None
        if settings.kv_snapshot_dir:
            from kvfleet.compute_service.kv.snapshot_io import snapshot_path

            self.path = snapshot_path(settings.kv_snapshot_dir, node_id)

    def _fingerprint_of(self, engine):
        from kvfleet.compute_service.kv.snapshot import Fingerprint, model_digest, seed_digest

        if self._fingerprint is None:
            mc, config = engine.model_config, engine.config
            self._fingerprint = Fingerprint(
                model_digest(self.model), config.dtype, engine.kv_cache_dtype, int(config.block_size),
                mc.num_layers, mc.num_kv_heads, mc.head_dim, seed_digest(engine.kv.seed))
        return self._fingerprint

    async def restore(self) -> int:
        """Restore the snapshot into the pool (before READY); the blocks restored (0: cold start)."""
        if self.path is None or not self.path.exists():
            return 0
        from kvfleet.compute_service.kv import snapshot_io as kv_snapshot_io
        from kvfleet.compute_service.kv.snapshot import SnapshotRefused

        started = time.perf_counter()
        fingerprint = await self.engine.call(self._fingerprint_of)
        seed = await self.engine.call(lambda e: e.kv.seed)
        try:
            snap = await asyncio.to_thread(kv_snapshot_io.read, self.path, fingerprint, seed)
            restored = await self.engine.call(lambda e: kv_snapshot_io.restore(
                snap, e.allocator, e.runner.kv_cache, e.runner.kv_scales, e.kv.usage, e.allocator.num_blocks))
        except SnapshotRefused as e:
            log.warning("node %s: KV snapshot %s refused: %s; starting cold", self.node_id, self.path, e)
            return 0
        except Exception as e:  # a node never fails to start over its snapshot; what was restored is sound
            log.warning("node %s: KV snapshot %s not restored (%s: %s); starting with what was", self.node_id,
                        self.path, type(e).__name__, e)
            return 0
        if self.flush is not None:
            await self.flush()
        self._saved_version = await self.engine.call(lambda e: e.kv.usage.version)
        log.info("node %s: restored %d of the %d blocks of KV snapshot %s in %.2fs", self.node_id, restored,
                 snap.num_blocks, self.path, time.perf_counter() - started)
        return restored

    async def random_prefill(self, vocab_size: int, max_model_len: int) -> float:
        """``--warmup random``: prefill random prompts of the size the first requests may have, so
        their shapes' memory and kernels are warm; seconds it took (0 when off)."""
        if self.settings.warmup != "random":
            return 0.0
        import random

        from kvfleet.core.sampling import SamplingParams

        started = time.perf_counter()
        rng = random.Random(0)
        length = max(1, min(self.settings.warmup_tokens, max_model_len - 8))
        one = SamplingParams(max_tokens=1, ignore_eos=True)

        async def prefill(i: int) -> None:
            prompt = [rng.randrange(vocab_size) for _ in range(length)]
            async for _ in self.engine.generate(f"warmup-random-{self.node_id}-{i}", prompt, one,
                                                tenant=WARMUP_TENANT):
                pass

        await asyncio.gather(*(prefill(i) for i in range(WARMUP_PROMPTS)))
        seconds = time.perf_counter() - started
        log.info("node %s: random-prefill warm-up of %d x %d tokens took %.2fs", self.node_id,
                 WARMUP_PROMPTS, length, seconds)
        return seconds

    async def save(self, why: str) -> bool:
        """Write a snapshot of the most reused blocks now; False when there was nothing new to write
        or the write failed (logged: a node never stops over its snapshot)."""
        if self.path is None:
            return False
        from kvfleet.compute_service.kv import snapshot_io as kv_snapshot_io

        started = time.perf_counter()
        limit = self.settings.kv_snapshot_blocks

        def take(e):
            version = e.kv.usage.version
            if version == self._saved_version:
                return version, None
            return version, kv_snapshot_io.capture(e.runner.kv_cache, e.runner.kv_scales, e.kv.usage,
                                                   self._fingerprint_of(e), self.node_id, limit)

        try:
            version, snap = await self.engine.call(take)
            if snap is None:
                return False
            size = await asyncio.to_thread(kv_snapshot_io.write, self.path, snap)
        except Exception as e:
            log.warning("node %s: KV snapshot (%s) not written: %s", self.node_id, why, e)
            return False
        self._saved_version = version
        log.info("node %s: KV snapshot (%s) of %d blocks, %.1f MiB, written to %s in %.2fs", self.node_id, why,
                 snap.num_blocks, size / (1 << 20), self.path, time.perf_counter() - started)
        return True

    def start_periodic(self) -> None:
        if self.path is not None and self.settings.kv_snapshot_interval_s > 0:
            self._periodic = asyncio.get_running_loop().create_task(self._every(self.settings.kv_snapshot_interval_s))

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


def preflight(settings: WarmStartSettings) -> None:
    """A snapshot directory that cannot be one is the person's mistake: said before the model loads."""
    from pathlib import Path

    from kvfleet.core.preflight import PreflightError

    directory = settings.kv_snapshot_dir
    if directory and Path(directory).exists() and not Path(directory).is_dir():
        raise PreflightError(f"--kv-snapshot-dir {directory} is not a directory")
