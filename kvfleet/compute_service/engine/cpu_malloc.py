"""glibc's heap kept for the engine's working set on CPU, so that a step's tensors do not fault in
their pages afresh at every step.

By default glibc serves an allocation of 128 KiB or more with a fresh ``mmap``, raising that limit
to the largest such block freed so far (never past 32 MiB), and gives the top of its heap back to
the kernel whenever more than twice that limit lies free there. A step's tensors (a 2,048-token
prefill of bench-small: 6-16 MiB each) are freed at its end, so the heap's top went back and every
step wrote its tensors into new pages, each 4 KiB a page fault: ~260,000 a bench-small float32 run
(~1 GiB), against ~300 with the heap kept (``bench/engine_vs_vllm.py``'s workload, measured with
``getrusage``). vLLM's CPU backend runs under tcmalloc for the same reason.

``keep_heap`` fixes both limits: blocks under 32 MiB (glibc's ceiling for the limit) come from
the heap, and up to ``TRIM_BYTES`` may lie free at its top. The memory kept is what the busiest step
took; the engine's peak is unchanged, and resident memory after a burst stays at that peak instead
of falling back. ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_`` in the environment (glibc's
own tunables) leave glibc as configured.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_BYTES = 32 << 20   # the most glibc takes (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_BYTES = 256 << 20  # free heap top kept: more than a 2,048-token step's tensors of a 7B model
ENV_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_heap(env: Mapping[str, str]) -> bool:
    """Set glibc's limits (once per process is enough; again is harmless). False where the C
    library is not glibc or the environment configures it."""
    if any(name in env for name in ENV_TUNABLES):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    done = mallopt(M_MMAP_THRESHOLD, MMAP_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    if done:
        log.debug("glibc heap kept: mmap threshold %d MiB, trim threshold %d MiB", MMAP_BYTES >> 20, TRIM_BYTES >> 20)
    return done
