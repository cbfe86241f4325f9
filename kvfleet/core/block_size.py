"""The block-size rule, once for every floor: a block holds a multiple of 16 tokens, 16 to 2048.

16 is the tile the paged-attention kernels read a block in; 2048 bounds the tail a sequence wastes
in its last block. block_service refuses a pool of another size, the compute node refuses to start
with one, the capacity planner refuses to plan one: all through ``check_block_size``.
"""

from __future__ import annotations

from kvfleet.core.errors import InvalidArgument

MIN_BLOCK_SIZE = 16
MAX_BLOCK_SIZE = 2048
BLOCK_SIZE_MULTIPLE = 16
BLOCK_SIZE_RULE = f"a multiple of {BLOCK_SIZE_MULTIPLE} in {MIN_BLOCK_SIZE}..{MAX_BLOCK_SIZE}"


def check_block_size(size: object, name: str = "block_size") -> int:
    """``size`` if it is a valid block size, else ``InvalidArgument`` (a ``ValueError``) in one
    line naming ``name`` (a field, or a flag such as ``--block-size``)."""
    if not (isinstance(size, int) and MIN_BLOCK_SIZE <= size <= MAX_BLOCK_SIZE and size % BLOCK_SIZE_MULTIPLE == 0):
        raise InvalidArgument(f"{name} must be {BLOCK_SIZE_RULE}, got {size!r}")
    return size
