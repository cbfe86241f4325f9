"""Tenants: who may call the cluster, and what each may hold — one type, one validation.

One YAML file is read by the router (API key → tenant, paid level, concurrency limit) and by
block_service (memory quota per tenant), so the type and its parser live here, shared::

    tenants:
      - name: acme
        api_key: sk-acme-123
        quota_mib: 512          # KV cache memory the tenant may hold on each node
        reserved_mib: 64        # optional: kept free for this tenant (default 0)
        paid_level: 2           # higher is served first under contention
        max_concurrent: 8       # requests running at once (0: no limit); more wait in the queue
        lower_tier_quota_mib: 2048  # optional: KV the tenant may keep in a node's host and disk tiers
                                    # (blocks demoted out of the device pool; default unlimited)
        cache_share_mib: 128    # optional: its share of a node's cached (evictable) KV under the
                                # fair eviction policies (default: reserved_mib); see kvfleet.block_service.eviction.fair
        pinned_mib: 16          # optional: KV it may pin on each node (requests' ``cache.pin``;
                                # default 0: no pins)
        prefix_group: acme-org  # optional: share cached prefixes with the group's other tenants
    prefix_groups: [acme-org]   # optional: the groups tenants may name (a typo is an error, not a group)

``Tenant`` is both the router's entry (with its key) and block_service's (``without_key()``: keys
never reach block_service's log or snapshots). A quota of ``None`` is unlimited: block_service's
in-process tenant, or one configured without a quota over its API; the file always gives one.
Every mistake in the file is reported with the tenant's position and field, so a person can fix it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from kvfleet.core.errors import InvalidArgument
from kvfleet.core.ids import check_id

_REQUIRED = ("name", "api_key", "quota_mib", "paid_level", "max_concurrent")
_OPTIONAL = ("reserved_mib", "lower_tier_quota_mib", "cache_share_mib", "pinned_mib", "prefix_group")
_TOP_LEVEL = ("tenants", "prefix_groups")
MIB = 1 << 20
MAX_MIB = float(1 << 40)  # more is a typo, not a quota
# a node's own warm-up requests run under this name: internal, never in a tenants file, never shown to users
WARMUP_TENANT = "__warmup__"


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message says where and why."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True, frozen=True)
class Tenant:
    """One tenant. Invalid fields raise ``InvalidArgument`` (a ``ValueError``) naming the field."""

    name: str
    api_key: str = ""               # "": no key (block_service's copy)
    quota_mib: float | None = None  # > 0; None: unlimited
    paid_level: int = 0             # >= 0
    max_concurrent: int = 0         # >= 0; 0 = no limit (enforced by the router's queue)
    reserved_mib: float = 0.0       # 0 <= reserved_mib <= quota_mib: kept free for this tenant
    # > 0; None: unlimited. A cap of its own for the node's lower tiers (host memory, disk): the
    # quota above charges only blocks in the device pool.
    lower_tier_quota_mib: float | None = None
    # >= 0; None: reserved_mib. Its share of a node's cached blocks under the fair eviction policies
    # (a weight: shares summing past a node's pool need no scaling, kvfleet.block_service.eviction.fair).
    cache_share_mib: float | None = None
    # >= 0: KV the tenant may pin on each node (0: it may not pin). Pins outlive floods until their TTL.
    pinned_mib: float = 0.0
    # None: its prefix chains are salted with its own name (isolated). A group: salted with the group,
    # so the group's tenants share cached prefixes (and only they: ``kvfleet.core.block_hash.cache_salt``).
    prefix_group: str | None = None

    def __post_init__(self) -> None:
        check_id("tenant name", self.name)
        if not self.name.strip():
            raise InvalidArgument(f"tenant name must not be blank, got {self.name!r}")
        if any(ord(c) < 32 for c in self.name):  # a NUL would let a name salt like a group (block_hash.GROUP_MARK)
            raise InvalidArgument(f"tenant name must not hold control characters, got {self.name!r}")
        if not isinstance(self.api_key, str) or any(c.isspace() for c in self.api_key):
            raise InvalidArgument(f"tenant {self.name!r}: api_key must be a string without spaces")
        q = self.quota_mib
        if q is not None and not (isinstance(q, (int, float)) and 0 < q < MAX_MIB):
            raise InvalidArgument(f"tenant {self.name!r}: quota_mib must be > 0, got {q}")
        lq = self.lower_tier_quota_mib
        if lq is not None and not (isinstance(lq, (int, float)) and not isinstance(lq, bool) and 0 < lq < MAX_MIB):
            raise InvalidArgument(f"tenant {self.name!r}: lower_tier_quota_mib must be > 0, got {lq}")
        cs = self.cache_share_mib
        if cs is not None and not (isinstance(cs, (int, float)) and not isinstance(cs, bool) and 0 <= cs < MAX_MIB):
            raise InvalidArgument(f"tenant {self.name!r}: cache_share_mib must be >= 0, got {cs}")
        pm = self.pinned_mib
        if not (isinstance(pm, (int, float)) and not isinstance(pm, bool) and 0 <= pm < MAX_MIB):
            raise InvalidArgument(f"tenant {self.name!r}: pinned_mib must be >= 0, got {pm}")
        if self.prefix_group is not None:
            if not isinstance(self.prefix_group, str):
                raise InvalidArgument(f"tenant {self.name!r}: prefix_group must be a string, got {self.prefix_group!r}")
            check_id("prefix group", self.prefix_group)
        r, most = self.reserved_mib, MAX_MIB if q is None else q
        if not (isinstance(r, (int, float)) and math.isfinite(r) and 0 <= r <= most):
            raise InvalidArgument(
                f"tenant {self.name!r}: reserved_mib must be between 0 and quota_mib ({q}), got {r}"
            )
        if not _is_int(self.paid_level) or self.paid_level < 0:
            raise InvalidArgument(f"tenant {self.name!r}: paid_level must be >= 0, got {self.paid_level}")
        if not _is_int(self.max_concurrent) or self.max_concurrent < 0:
            raise InvalidArgument(
                f"tenant {self.name!r}: max_concurrent must be >= 0 (0: no limit), got {self.max_concurrent}"
            )

    def without_key(self) -> Tenant:
        """The copy block_service keeps: everything but the API key."""
        return replace(self, api_key="") if self.api_key else self

    def quota_blocks(self, bytes_per_block: int) -> int | None:
        """The quota as whole blocks of a pool whose blocks take ``bytes_per_block`` bytes."""
        if self.quota_mib is None:
            return None
        return int(self.quota_mib * MIB) // bytes_per_block

    def lower_tier_quota_blocks(self, bytes_per_block: int) -> int | None:
        """The lower-tier cap as whole blocks of ``bytes_per_block`` bytes (None: unlimited)."""
        if self.lower_tier_quota_mib is None:
            return None
        return int(self.lower_tier_quota_mib * MIB) // bytes_per_block

    def reserved_blocks(self, bytes_per_block: int) -> int:
        return int(self.reserved_mib * MIB) // bytes_per_block

    def cache_share_blocks(self, bytes_per_block: int) -> int:
        """Its share of a node's cached blocks: ``cache_share_mib``, else ``reserved_mib``, in blocks."""
        mib = self.reserved_mib if self.cache_share_mib is None else self.cache_share_mib
        return int(mib * MIB) // bytes_per_block

    def pinned_blocks(self, bytes_per_block: int) -> int:
        """The blocks it may pin on a node whose blocks take ``bytes_per_block`` bytes."""
        return int(self.pinned_mib * MIB) // bytes_per_block


def _number(entry: Mapping, field: str, kind: type, where: str) -> float | int:
    value = entry[field]
    # bool is an int in Python; `paid_level: yes` is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        wanted = "a number" if kind is float else "an integer"
        raise TenantsFileError(f"{where}: {field} must be {wanted}, got {value!r}")
    return kind(value)


def parse_tenants(data: object, source: str = "tenants file") -> list[Tenant]:
    """Tenants from the parsed YAML document ``data``; raises ``TenantsFileError``."""
    if not isinstance(data, Mapping) or "tenants" not in data:
        raise TenantsFileError(f"{source}: expected a mapping with a 'tenants:' list at the top")
    unknown_top = sorted(set(map(str, data)) - set(_TOP_LEVEL))
    if unknown_top:
        raise TenantsFileError(f"{source}: unknown top-level field(s) {', '.join(unknown_top)}")
    groups = _prefix_groups(data.get("prefix_groups", []), source)
    entries = data["tenants"]
    if not isinstance(entries, list) or not entries:
        raise TenantsFileError(f"{source}: 'tenants' must be a non-empty list")
    tenants: list[Tenant] = []
    for i, entry in enumerate(entries):
        where = f"{source}: tenants[{i}]"
        if not isinstance(entry, Mapping):
            raise TenantsFileError(f"{where}: expected a mapping, got {entry!r}")
        if isinstance(entry.get("name"), str):
            where += f" ({entry['name']})"
        missing = [f for f in _REQUIRED if f not in entry]
        if missing:
            raise TenantsFileError(f"{where}: missing {', '.join(missing)}")
        unknown = sorted(set(entry) - set(_REQUIRED) - set(_OPTIONAL))
        if unknown:
            raise TenantsFileError(f"{where}: unknown field(s) {', '.join(map(str, unknown))}")
        for field in ("name", "api_key"):
            if not isinstance(entry[field], str):
                raise TenantsFileError(f"{where}: {field} must be a string, got {entry[field]!r}")
        group = entry.get("prefix_group")
        if group is not None and not isinstance(group, str):
            raise TenantsFileError(f"{where}: prefix_group must be a string, got {group!r}")
        if group is not None and group not in groups:
            raise TenantsFileError(f"{where}: prefix_group {group!r} is not one of the file's prefix_groups "
                                   f"({', '.join(sorted(groups)) or 'none declared'})")
        if not entry["api_key"]:
            raise TenantsFileError(f"{where}: api_key must not be empty: the router finds tenants by key")
        try:
            tenants.append(
                Tenant(
                    name=entry["name"],
                    api_key=entry["api_key"],
                    quota_mib=_number(entry, "quota_mib", float, where),
                    reserved_mib=_number(entry, "reserved_mib", float, where) if "reserved_mib" in entry else 0.0,
                    paid_level=_number(entry, "paid_level", int, where),
                    max_concurrent=_number(entry, "max_concurrent", int, where),
                    lower_tier_quota_mib=(_number(entry, "lower_tier_quota_mib", float, where)
                                          if "lower_tier_quota_mib" in entry else None),
                    cache_share_mib=(_number(entry, "cache_share_mib", float, where)
                                     if "cache_share_mib" in entry else None),
                    pinned_mib=_number(entry, "pinned_mib", float, where) if "pinned_mib" in entry else 0.0,
                    prefix_group=group,
                )
            )
        except ValueError as e:
            if isinstance(e, TenantsFileError):
                raise
            why = str(e).removeprefix(f"tenant {entry['name']!r}: ")  # ``where`` names it already
            raise TenantsFileError(f"{where}: {why}") from None
    _check_unique(tenants, source)
    return tenants


def _prefix_groups(value: object, source: str) -> set[str]:
    """The declared group names (a list of distinct ids)."""
    if not isinstance(value, list) or not all(isinstance(g, str) for g in value):
        raise TenantsFileError(f"{source}: prefix_groups must be a list of names, got {value!r}")
    for g in value:
        try:
            check_id("prefix group", g)
        except ValueError as e:
            raise TenantsFileError(f"{source}: prefix_groups: {e}") from None
    if len(set(value)) != len(value):
        raise TenantsFileError(f"{source}: prefix_groups names a group twice")
    return set(value)


def _check_unique(tenants: Iterable[Tenant], source: str) -> None:
    names: set[str] = set()
    keys: set[str] = set()
    for t in tenants:
        if t.name in names:
            raise TenantsFileError(f"{source}: tenant name {t.name!r} appears twice")
        if t.api_key in keys:
            raise TenantsFileError(f"{source}: tenant {t.name!r} reuses another tenant's api_key")
        names.add(t.name)
        keys.add(t.api_key)


def load_tenants(path: str | Path) -> list[Tenant]:
    """Read and validate the tenants file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TenantsFileError(f"{path}: cannot read tenants file: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TenantsFileError(f"{path}: not valid YAML: {e}") from None
    return parse_tenants(data, str(path))
