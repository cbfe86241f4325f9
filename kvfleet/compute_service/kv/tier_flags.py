"""The rules between the lower KV tiers' settings (``EngineConfig`` declares each one), checked
before anything loads. Pure Python: no torch.

    --kv-host-memory BYTES                 host tier (0: none, the default)
    --kv-disk-dir DIR --kv-disk-bytes B    disk tier below it (needs a host tier)
    --preemption-mode auto|swap|recompute  how a preempted sequence's KV comes back
"""

from __future__ import annotations

import os
from pathlib import Path

from kvfleet.compute_service.engine.swap_cost import parse_preemption_mode


def check_tier_flags(host_memory: int, disk_dir: str | None, disk_bytes: int, preemption_mode: str) -> None:
    """``ValueError`` (one line) for tier flags that cannot work; touches nothing but the disk
    directory's existence and writability."""
    parse_preemption_mode(preemption_mode)
    if host_memory < 0 or disk_bytes < 0:
        raise ValueError(f"--kv-host-memory and --kv-disk-bytes must be >= 0 bytes, got {host_memory} and {disk_bytes}")
    if (disk_dir is None) != (disk_bytes == 0):
        raise ValueError("--kv-disk-dir and --kv-disk-bytes go together (a directory and its size in bytes)")
    if disk_dir is not None and host_memory == 0:
        raise ValueError("the disk tier holds blocks the host tier cascades: --kv-disk-dir needs --kv-host-memory")
    if preemption_mode == "swap" and host_memory == 0:
        raise ValueError("--preemption-mode swap copies victims to the host tier: it needs --kv-host-memory")
    if host_memory and host_memory > _physical_memory():
        raise ValueError(f"--kv-host-memory {host_memory} bytes is more than this machine's memory "
                         f"({_physical_memory()} bytes)")
    if disk_dir is not None:
        path = Path(disk_dir)
        if path.exists() and not path.is_dir():
            raise ValueError(f"--kv-disk-dir {disk_dir} is not a directory")
        probe = path if path.exists() else next((p for p in path.parents if p.exists()), Path("/"))
        if not probe.is_dir():
            raise ValueError(f"--kv-disk-dir {disk_dir} cannot be created: {probe} is not a directory")
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ValueError(f"--kv-disk-dir {disk_dir} cannot be written by this user")


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
