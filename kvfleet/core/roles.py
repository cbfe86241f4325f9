"""What a compute node is for, in a cluster that splits prefill from decode. Pure.

    mixed    prefills and decodes (the default; a cluster of mixed nodes is what kvfleet always ran)
    prefill  computes prompts and their first token, then the router hands the sequence over
    decode   continues sequences handed over (fetching their KV from the prefill node), and runs
             requests whose uncached prompt is short where they land

A node publishes its role in its membership record; the router reads it there (``kvfleet/router/relay.py``).
"""

from __future__ import annotations

MIXED, PREFILL, DECODE = "mixed", "prefill", "decode"
ROLES = (MIXED, PREFILL, DECODE)


def check_role(value: object) -> str:
    if value not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {value!r}")
    return value
