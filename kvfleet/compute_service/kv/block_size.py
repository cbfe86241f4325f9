"""The block size a node takes: tokens per KV block, a multiple of 16 in 16-2048 (the fleet's
rule, ``kvfleet.core.block_size``), or a preset named after the work it suits. Pure: the command
line validates here without importing torch."""

from __future__ import annotations

from kvfleet.core.block_size import BLOCK_SIZE_RULE, check_block_size

BLOCK_SIZE_PRESETS = {"chat": 256, "code": 512, "document": 1024}


def parse_block_size(value: int | str) -> int:
    """A block size (multiple of 16 in 16–2048) or a preset name (chat, code, document)."""
    if isinstance(value, str) and value.strip() in BLOCK_SIZE_PRESETS:
        return BLOCK_SIZE_PRESETS[value.strip()]
    try:
        size = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        size = None
    if size is None:
        raise ValueError(f"--block-size must be {BLOCK_SIZE_RULE} or one of {', '.join(BLOCK_SIZE_PRESETS)}, got {value!r}")
    return check_block_size(size, "--block-size")
