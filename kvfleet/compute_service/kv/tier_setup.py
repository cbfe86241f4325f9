"""Building an engine's lower KV tiers from its flags: sizes checked, the disk directory prepared,
and the swap cost model measured on this machine (``swap_cost.py``).

    --kv-host-memory BYTES                 host tier (0: none, the default)
    --kv-disk-dir DIR --kv-disk-bytes B    disk tier below it (needs a host tier)
    --preemption-mode auto|swap|recompute  how a preempted sequence's KV comes back
"""

from __future__ import annotations

import logging
import time

import torch

from kvfleet.compute_service.engine.swap_cost import SwapCost
from kvfleet.compute_service.kv.tier_flags import check_tier_flags
from kvfleet.compute_service.kv.tier_store import KVTierStore, Record

log = logging.getLogger(__name__)

MEASURE_BLOCKS = 8  # blocks copied each way to measure the copy bandwidth at start


def build_tiers(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, block_size: int, bytes_per_block: int,
                record: Record, host_memory: int, disk_dir: str | None, disk_bytes: int,
                preemption_mode: str, prefill_tokens_per_s=None) -> KVTierStore | None:
    """The store, or None without a host tier. ``prefill_tokens_per_s`` (a callable measuring it)
    is called only when the cost model needs it (``auto``)."""
    check_tier_flags(host_memory, disk_dir, disk_bytes, preemption_mode)
    host_blocks = host_memory // bytes_per_block
    if host_blocks == 0:
        if host_memory:
            raise ValueError(f"--kv-host-memory {host_memory} bytes holds no KV block of {bytes_per_block} bytes")
        return None
    disk_blocks = disk_bytes // bytes_per_block
    if disk_dir is not None and disk_blocks == 0:
        raise ValueError(f"--kv-disk-bytes {disk_bytes} holds no KV block of {bytes_per_block} bytes")
    try:
        store = KVTierStore(kv_cache, kv_scales, block_size, host_blocks, record, disk_dir, disk_blocks, preemption_mode)
    except OSError as e:
        raise ValueError(f"--kv-disk-dir {disk_dir}: {e.strerror or e}") from None
    except RuntimeError as e:  # the host tensors could not be allocated (pinned memory refused)
        raise ValueError(f"--kv-host-memory {host_memory} bytes could not be allocated: "
                         f"{(str(e).splitlines() or ['?'])[0]}") from None
    if preemption_mode == "auto":
        out_rate, in_rate = store.measure(MEASURE_BLOCKS)
        store.cost = SwapCost(out_rate, in_rate, prefill_tokens_per_s())
        log.info("swap cost model: copies %.0f MB/s out, %.0f MB/s in; prefill %.0f tokens/s",
                 out_rate / 1e6, in_rate / 1e6, store.cost.prefill_tokens_per_s)
    if disk_dir is not None:
        log.info("KV disk tier: %d blocks in %s (its block files were wiped at start: the directory is this "
                 "node's own)", store.index.disk_blocks, disk_dir)
    return store


def measure_prefill(runner_factory, num_tokens: int, block_size: int) -> float:
    """Prefill tokens per second of one ``num_tokens`` chunk through a scratch pool
    (``runner_factory(num_blocks)`` -> a ModelRunner), after one warm-up pass."""
    from kvfleet.compute_service.engine.scheduler import ScheduledBatch
    from kvfleet.compute_service.engine.sequence import Sequence
    from kvfleet.core.sampling import SamplingParams

    num_blocks = -(-num_tokens // block_size)
    runner = runner_factory(num_blocks)
    seq = Sequence("tier-warmup", [i % 100 for i in range(num_tokens)], SamplingParams())
    seq.block_table = list(range(num_blocks))
    batch = ScheduledBatch(prefills=[(seq, num_tokens)])
    runner.execute(batch)
    _sync(runner.device)
    start = time.perf_counter()
    runner.execute(batch)
    _sync(runner.device)
    return num_tokens / max(time.perf_counter() - start, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
