"""The request ids running now, per tenant (pure).

``request_id`` is the client's idempotency key: a second call with the id of a call still running
is refused (→ ALREADY_EXISTS) rather than doing the same work twice and streaming it to two
callers. Ids are per tenant, as everywhere in the router (two tenants may pick the same id), and an
id is free again once its call is over, so a client may retry a request that failed.
"""

from __future__ import annotations


class AlreadyRunning(Exception):
    """The tenant already has a call with this request id in flight (→ ALREADY_EXISTS)."""


class RunningIds:
    def __init__(self) -> None:
        self._running: set[tuple[str, str]] = set()

    def __len__(self) -> int:
        return len(self._running)

    def is_running(self, tenant: str, request_id: str) -> bool:
        return (tenant, request_id) in self._running

    def claim(self, tenant: str, request_id: str) -> None:
        """Mark the id running; call ``release`` when the call is over, however it ends."""
        key = (tenant, request_id)
        if key in self._running:
            raise AlreadyRunning(f"request_id {request_id} is already running")
        self._running.add(key)

    def release(self, tenant: str, request_id: str) -> None:
        key = (tenant, request_id)
        assert key in self._running, f"release of {key}, which was not claimed"
        self._running.remove(key)
