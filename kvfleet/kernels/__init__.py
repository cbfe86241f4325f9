"""Paged-attention kernels: Triton on GPU, a native C++ decode kernel on CPU, torch references for both.

The engine calls only ``store_kv``, ``paged_decode`` and ``paged_prefill``; ``kvfleet.kernels.attention`` picks
the implementation (see ``kvfleet/kernels/README.md``).
"""

from kvfleet.kernels.attention import paged_decode, paged_prefill, store_kv

__all__ = ["paged_decode", "paged_prefill", "store_kv"]
