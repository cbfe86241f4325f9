"""The tenants file: who may call the cluster, and what each may hold.

One YAML file is read by the router (API key → tenant, paid level, concurrency limit) and by
block_service (memory quota per tenant), so its parser lives here, shared::

    tenants:
      - name: acme
        api_key: sk-acme-123
        quota_mib: 512          # KV cache memory the tenant may hold on each node
        reserved_mib: 64        # optional: kept free for this tenant (default 0)
        paid_level: 2           # higher is served first under contention
        max_concurrent: 8       # requests running at once (0: no limit); more wait in the queue

Every mistake is reported with the tenant's position and field, so a person can fix the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

_REQUIRED = ("name", "api_key", "quota_mib", "paid_level", "max_concurrent")
_OPTIONAL = ("reserved_mib",)


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message says where and why."""


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    api_key: str
    quota_mib: float        # > 0
    paid_level: int         # >= 0
    max_concurrent: int     # >= 0; 0 = no limit
    reserved_mib: float = 0.0  # 0 <= reserved_mib <= quota_mib

    def __post_init__(self) -> None:
        if not self.name or not self.name.strip():
            raise ValueError("name must be a non-empty string")
        if not self.api_key or any(c.isspace() for c in self.api_key):
            raise ValueError("api_key must be a non-empty string without spaces")
        if not self.quota_mib > 0:
            raise ValueError(f"quota_mib must be > 0, got {self.quota_mib}")
        if not 0 <= self.reserved_mib <= self.quota_mib:
            raise ValueError(
                f"reserved_mib must be between 0 and quota_mib ({self.quota_mib}), got {self.reserved_mib}"
            )
        if self.paid_level < 0:
            raise ValueError(f"paid_level must be >= 0, got {self.paid_level}")
        if self.max_concurrent < 0:
            raise ValueError(f"max_concurrent must be >= 0 (0: no limit), got {self.max_concurrent}")

    def quota_blocks(self, bytes_per_block: int) -> int:
        """The quota as whole blocks of a pool whose blocks take ``bytes_per_block`` bytes."""
        return int(self.quota_mib * 2**20) // bytes_per_block


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
        try:
            tenants.append(
                Tenant(
                    name=entry["name"],
                    api_key=entry["api_key"],
                    quota_mib=_number(entry, "quota_mib", float, where),
                    reserved_mib=_number(entry, "reserved_mib", float, where) if "reserved_mib" in entry else 0.0,
                    paid_level=_number(entry, "paid_level", int, where),
                    max_concurrent=_number(entry, "max_concurrent", int, where),
                )
            )
        except ValueError as e:
            if isinstance(e, TenantsFileError):
                raise
            raise TenantsFileError(f"{where}: {e}") from None
    _check_unique(tenants, source)
    return tenants


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
