"""The KV layout: how a sequence takes its blocks from the pool (``--kv-layout``). Pure: the command
line validates here without importing torch.

- ``paged`` (default): blocks as the sequence grows (its prompt at admission, one more per
  ``block_size`` generated tokens); full blocks are committed under their hashes and shared by
  later prompts with the same prefix. Waste: the unfilled tail of each sequence's last block.
- ``contiguous``: the traditional scheme, kept as a measured baseline (``bench/kv_layout.py``).
  At admission a sequence reserves ``max_model_len`` token slots, ``ceil(max_model_len /
  block_size)`` blocks, and holds them until it finishes; nothing is looked up in or committed to
  the prefix cache. Admission waits while the reservation does not fit. Waste: every reserved
  slot the sequence never writes.

Both run on the same pool, page table and kernels (a reservation is an ordinary block table the
sequence never grows), so their outputs are token-identical. The reservation is allocated like any
other, so block_service charges all of it to the tenant (its quota included) from admission to
finish, and counts the sequence as ``max_model_len`` tokens long: its fill-level and
fragmentation figures read a reservation as written (the engine's side is in the benchmark).
"""

from __future__ import annotations

PAGED, CONTIGUOUS = "paged", "contiguous"
KV_LAYOUTS = (PAGED, CONTIGUOUS)


def parse_kv_layout(name: str) -> str:
    """``name`` if it is a layout, else ``ValueError`` in one line."""
    if name not in KV_LAYOUTS:
        raise ValueError(f"--kv-layout must be one of {', '.join(KV_LAYOUTS)}, got {name!r}")
    return name


def reserved_tokens(layout: str, max_model_len: int) -> int | None:
    """Token slots a sequence reserves at admission: ``max_model_len`` when contiguous, None
    when paged (it takes what its tokens need, as they come)."""
    return max_model_len if parse_kv_layout(layout) == CONTIGUOUS else None
