"""What the CPU host offers the engine: how many intra-op threads to run, and whether bfloat16 is
native. Pure (no torch): the engine applies the answers.

Threads. torch's default is one OpenMP thread per usable CPU. Every matmul and attention call is
then a parallel region that ends in a barrier, so one step waits for its slowest thread: when
another process (a neighbour on a shared host, this engine's own gRPC and scheduling threads)
holds one of the CPUs, the barrier waits out the scheduler's time slice. On a 2-CPU host under load
that made the engine 4-5x slower than with one thread (docs/benchmarks-history.md, "Engine vs vLLM-CPU").
vLLM's CPU backend reserves one CPU per worker for its scheduler and binds its OpenMP threads to
the rest; the engine weighs that count (usable CPUs - 1, at least 1) against all CPUs
(``thread_governor.py``), starting at all of them and leaving them while they measure slower.
``KVFLEET_CPU_THREADS=N`` fixes N; an ``OMP_NUM_THREADS`` set in the environment is left to torch.

Dtype. ``auto`` is bfloat16 on a CPU whose matmuls run bfloat16 natively (AMX or AVX512-BF16:
oneDNN's bf16 kernels there run about twice float32's rate) and float32 elsewhere; float32 stays the
choice for results token-exact against transformers' float32. ``KVFLEET_DEFAULT_DTYPE=float32|bfloat16``
fixes what ``auto`` resolves to, whatever the CPU: a test (``tests/bench/test_bench_smoke.py``) runs every
benchmark under both defaults on one machine, so none of them breaks on a CPU its author did not have.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

THREADS_ENV = "KVFLEET_CPU_THREADS"
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
DEFAULT_DTYPE_ENV = "KVFLEET_DEFAULT_DTYPE"
DEFAULT_DTYPES = ("float32", "bfloat16")  # what the override may choose


def intra_op_threads(usable_cpus: int, env: Mapping[str, str]) -> int | None:
    """Threads the engine should give torch on CPU, or None to leave torch's own choice
    (``OMP_NUM_THREADS`` set by whoever started this process). ``ValueError`` in one line for a
    ``KVFLEET_CPU_THREADS`` that is not a positive integer."""
    chosen = env.get(THREADS_ENV)
    if chosen is not None:
        if not chosen.strip().isdigit() or int(chosen) < 1:
            raise ValueError(f"{THREADS_ENV} must be a positive integer, got {chosen!r}")
        return int(chosen)
    if env.get("OMP_NUM_THREADS"):
        return None
    return max(1, usable_cpus - 1)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in ``/proc/cpuinfo``'s text."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """This host's CPU flags (none where ``/proc/cpuinfo`` cannot be read: not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return cpu_flags(f.read())
    except OSError:
        return frozenset()


def resolve_dtype(name: str, device_type: str, flags: frozenset[str], env: Mapping[str, str] | None = None) -> str:
    """The concrete dtype for ``name``: ``auto`` is ``env[KVFLEET_DEFAULT_DTYPE]`` where set, else bfloat16
    on a CPU with native bfloat16 (one of ``NATIVE_BF16_FLAGS``), float32 on other CPUs and on other
    devices; other names pass through. ``ValueError`` in one line for an override not in ``DEFAULT_DTYPES``."""
    if name != "auto":
        return name
    chosen = (env or {}).get(DEFAULT_DTYPE_ENV)
    if chosen:
        if chosen not in DEFAULT_DTYPES:
            raise ValueError(f"{DEFAULT_DTYPE_ENV} must be one of {', '.join(DEFAULT_DTYPES)}, got {chosen!r}")
        return chosen
    if device_type == "cpu" and any(flag in flags for flag in NATIVE_BF16_FLAGS):
        return "bfloat16"
    return "float32"
