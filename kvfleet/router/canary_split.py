"""Which group serves a new conversation: a deterministic hash against the canary's share. Pure.

    key   = the client's conversation id (OpenAI ``prompt_cache_key``, else ``user``),
            else for a chat its messages up to and including the first user message,
            else the prompt's first ``KEY_TOKENS`` tokens
    point = blake2b(tenant, key) as a number in [0, 1)
    group = canary when point < share (and the split's tenant, if any, is this tenant), else stable

Sticky: every turn of a conversation has the same key, so the same group, and its prefix stays
cached where it is. Monotone: raising the share from 0.1 to 0.2 keeps every canary conversation on
the canary and moves only new points in [0.1, 0.2) over. The tenant is in the hash so that two
tenants' conversations with the same first message are independent draws.

KV-aware routing then runs among the chosen side's READY nodes (``in_group``); a side with none
(not started, failed its health checks, every node excluded by failures) leaves the request to the
other, so a canary that dies costs no request.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TypeVar

from kvfleet.core.canary import CanarySplit
from kvfleet.core.groups import CANARY, STABLE, side

KEY_TOKENS = 256
_SCALE = float(1 << 64)


def conversation_key(explicit: str = "", chat: Sequence[tuple[str, str]] = (),
                     prompt_ids: Sequence[int] = ()) -> bytes:
    """The bytes that name a conversation (see the module's docstring)."""
    if explicit:
        return b"id\0" + explicit.encode()
    if chat:
        head: list[str] = []
        for role, content in chat:
            head += [role, content]
            if role == "user":
                break
        return b"chat\0" + "\0".join(head).encode()
    return b"tokens\0" + struct.pack(f"<{min(len(prompt_ids), KEY_TOKENS)}I", *prompt_ids[:KEY_TOKENS])


def point(tenant: str, key: bytes) -> float:
    """The conversation's place in [0, 1), uniform over keys."""
    digest = hashlib.blake2b(tenant.encode() + b"\0" + key, digest_size=8, person=b"kvfleet-canary").digest()
    return int.from_bytes(digest, "little") / _SCALE


def assign(split: CanarySplit | None, tenant: str, key: bytes) -> str:
    """``CANARY`` or ``STABLE`` for the conversation ``key`` of ``tenant`` under ``split`` (None: no canary)."""
    if split is None or split.share <= 0.0 or (split.tenant and split.tenant != tenant):
        return STABLE
    return CANARY if point(tenant, key) < split.share else STABLE


N = TypeVar("N")


def in_group(nodes: Sequence[N], group: str | None, group_of=lambda n: n.info.group) -> list[N]:
    """The nodes of ``group``'s side (``kvfleet.core.groups.side``); all of ``nodes`` when that side has
    none, or when ``group`` is None (no canary split)."""
    if group is None:
        return list(nodes)
    mine = [n for n in nodes if side(group_of(n)) == group]
    return mine or list(nodes)
