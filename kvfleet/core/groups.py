"""Node groups: which configuration a compute node runs, for a canary (``kvfleet canary``). Pure.

Every node belongs to one group, ``stable`` unless its ``--group`` says otherwise. The router sends a
share of new conversations to the nodes of the ``canary`` group (``kvfleet/router/canary_split.py``) and the
rest to every other node, so a canary's figures can be compared with the rest of the fleet's under
the same traffic. A group is an id: letters, digits, ``_``, ``-`` and ``.``, at most 64 characters,
so that it can be a Prometheus label value and a word in a log line as it is.
"""

from __future__ import annotations

import re

STABLE, CANARY = "stable", "canary"
MAX_GROUP_LEN = 64
_GROUP = re.compile(r"[A-Za-z0-9_.-]+")


def check_group(value: object) -> str:
    """``value`` if it is a valid group name, else ``ValueError`` (one line)."""
    if not isinstance(value, str) or len(value) > MAX_GROUP_LEN or not _GROUP.fullmatch(value):
        raise ValueError(f"group must be 1..{MAX_GROUP_LEN} letters, digits, '_', '-' or '.', got {value!r}")
    return value


def side(group: str) -> str:
    """The side of a split a node of ``group`` serves: the canary's, or stable (every other group)."""
    return CANARY if group == CANARY else STABLE
