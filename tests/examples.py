"""How many examples a property or state-machine test runs: its full count in ``make test`` (CI), a
fifth of it (at least 10) in ``make test-fast``, the inner loop, which sets ``KVFLEET_TESTS=fast``.
The same rules and invariants run in both; the fast tier explores fewer interleavings."""

from __future__ import annotations

import os

FAST = os.environ.get("KVFLEET_TESTS") == "fast"


def examples(full: int) -> int:
    return max(10, full // 5) if FAST else full
