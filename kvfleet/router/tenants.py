"""Who is calling: the router's view of the tenants file (``kvfleet.core.tenants``).

The router needs three things from a tenant: to find it by API key, its paid level relative to the
best paid level on file (for queue scores), and its concurrency limit.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

from kvfleet.core.tenants import Tenant, load_tenants

AUTHORIZATION = "authorization"  # gRPC hands metadata keys over in lower case
BEARER = "bearer "


class AuthError(Exception):
    """No usable API key, or one that no tenant holds (→ UNAUTHENTICATED)."""


class TenantDirectory:
    def __init__(self, tenants: Iterable[Tenant]):
        tenants = list(tenants)
        keyless = [t.name for t in tenants if not t.api_key]
        if keyless:  # block_service's copies have none; the router finds tenants by key
            raise ValueError(f"tenants without an api_key cannot authenticate: {', '.join(keyless)}")
        self._by_key: dict[str, Tenant] = {t.api_key: t for t in tenants}
        self._by_name: dict[str, Tenant] = {t.name: t for t in self._by_key.values()}
        if not self._by_key:
            raise ValueError("a tenant directory needs at least one tenant")
        self.max_paid_level = max(t.paid_level for t in self._by_key.values())

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        return cls(load_tenants(path))

    def __len__(self) -> int:
        return len(self._by_key)

    def names(self) -> list[str]:
        return list(self._by_name)

    def by_name(self, name: str) -> Tenant:
        return self._by_name[name]

    def lookup(self, api_key: str) -> Tenant | None:
        # Compare in constant time so a key cannot be guessed byte by byte from timings.
        for key, tenant in self._by_key.items():
            if hmac.compare_digest(key.encode(), api_key.encode()):
                return tenant
        return None

    def authenticate_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> Tenant:
        """The tenant named by a call's metadata: two ``authorization`` entries are refused, not
        resolved by picking one (a proxy that adds its own would otherwise decide who calls)."""
        values = [value for key, value in metadata if key == AUTHORIZATION]
        if len(values) > 1:
            raise AuthError(f"exactly one authorization header may be sent, got {len(values)}")
        return self.authenticate(values[0] if values else None)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant named by an ``authorization: Bearer <key>`` header value."""
        if not authorization:
            raise AuthError("missing API key: send metadata 'authorization: Bearer <key>'")
        if not authorization.lower().startswith(BEARER):
            raise AuthError("malformed authorization metadata: expected 'Bearer <key>'")
        key = authorization[len(BEARER):].strip()
        tenant = self.lookup(key) if key else None
        if tenant is None:
            raise AuthError("unknown API key")
        return tenant

    def concurrency_limits(self) -> dict[str, int]:
        """Tenant name → max concurrent requests, for the tenants that have a limit."""
        return {t.name: t.max_concurrent for t in self._by_key.values() if t.max_concurrent > 0}

    def normalised_paid_level(self, tenant: Tenant) -> float:
        """``paid_level`` scaled to [0, 1] by the best paid level on file."""
        return tenant.paid_level / self.max_paid_level if self.max_paid_level else 0.0
