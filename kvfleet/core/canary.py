"""A canary's state in etcd: which share of new conversations the canary group gets, and the rollout
an operator asked for. Pure (JSON in, JSON out); ``kvfleet canary`` writes it, the router and
``kvfleet up`` watch it.

    /kvfleet/canary/split     CanarySplit: share, tenant, started_at, the canary config's name and text,
                              and ``problem`` (why the canary serves nothing, e.g. its config did not load)
    /kvfleet/canary/rollout   Rollout: promote (stable nodes restarted one at a time with the canary's
                              configuration) or rollback (the canary nodes with the stable one)

One key per concern, so every router replica agrees on the split and a restarted router reads it
back: the split is never a router flag. Only the operator (``admin``, etcd's root role) may write
under the prefix; the router reads it (``kvfleet.cli.etcd_auth``: the router reads all of /kvfleet/).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import ClassVar

CANARY_PREFIX = "/kvfleet/canary/"
SPLIT, ROLLOUT = "split", "rollout"  # the keys under the prefix
PROMOTE, ROLLBACK = "promote", "rollback"


def check_share(value: object) -> float:
    """``value`` as a share of conversations in [0, 1], else ``ValueError`` (one line)."""
    try:
        share = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"share must be a number in [0, 1], got {value!r}") from None
    if math.isnan(share) or not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be in [0, 1], got {value!r}")
    return share


class _JsonRecord:
    """An etcd value as sorted JSON: ``to_json``, and ``from_json`` (``ValueError`` for a value that
    is not one, naming ``WHAT``)."""

    __slots__ = ()
    WHAT: ClassVar[str] = "record"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, value: bytes):
        try:
            return cls(**_known(cls, json.loads(value)))
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a {cls.WHAT}: {e}") from None


@dataclass(slots=True, frozen=True)
class CanarySplit(_JsonRecord):
    WHAT: ClassVar[str] = "canary split"
    share: float = 0.0        # of new conversations (of ``tenant``'s, when set) sent to the canary group
    tenant: str = ""          # "": every tenant's conversations
    started_at: float = 0.0   # unix seconds when the split was set
    config_name: str = ""     # the canary's configuration file, as given to ``kvfleet up --canary-config``
    config_text: str = ""     # its text (what ``promote`` rolls out)
    problem: str = ""         # why the canary serves nothing ("": none known)

    def __post_init__(self) -> None:
        object.__setattr__(self, "share", check_share(self.share))



@dataclass(slots=True, frozen=True)
class Rollout(_JsonRecord):
    WHAT: ClassVar[str] = "canary rollout"
    action: str               # PROMOTE or ROLLBACK
    config_text: str          # the configuration every node of the side being restarted gets
    requested_at: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in (PROMOTE, ROLLBACK):
            raise ValueError(f"rollout action must be {PROMOTE} or {ROLLBACK}, got {self.action!r}")



def _known(cls: type, fields: object) -> dict:
    """The fields of ``cls`` in a decoded JSON object (a newer writer's extra fields left out)."""
    if not isinstance(fields, dict):
        raise TypeError(f"expected an object, got {type(fields).__name__}")
    return {k: v for k, v in fields.items() if k in cls.__dataclass_fields__}
