"""The canary's keys in etcd, read and written as the operator (``kvfleet.core.canary``).

Under mutual TLS etcd's roles let only ``admin`` (root) write ``/kvfleet/canary/``: a client with
another identity's certificate is refused by etcd itself, one without any by TLS. In plaintext
(``--insecure-internal``) anyone on the machine may: that is what plaintext means, and it is logged
as such at the cluster's start.
"""

from __future__ import annotations

from kvfleet.core.canary import CANARY_PREFIX, ROLLOUT, SPLIT, CanarySplit, Rollout
from kvfleet.core.membership import NodeInfo, etcd_client, list_nodes


class CanaryStore:
    """An open etcd client, as the operator: ``async with CanaryStore(url, credentials) as store``."""

    def __init__(self, url: str, credentials=None, timeout: float = 5.0):
        self._client = etcd_client(url, timeout=timeout, credentials=credentials)

    async def __aenter__(self) -> CanaryStore:
        await self._client.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.close()

    async def _get(self, key: str) -> bytes | None:
        got = await self._client.get((CANARY_PREFIX + key).encode())
        return None if got is None else got.value

    async def split(self) -> CanarySplit | None:
        value = await self._get(SPLIT)
        return None if value is None else CanarySplit.from_json(value)

    async def put_split(self, split: CanarySplit) -> None:
        await self._client.put((CANARY_PREFIX + SPLIT).encode(), split.to_json())

    async def rollout(self) -> Rollout | None:
        value = await self._get(ROLLOUT)
        return None if value is None else Rollout.from_json(value)

    async def put_rollout(self, rollout: Rollout) -> None:
        await self._client.put((CANARY_PREFIX + ROLLOUT).encode(), rollout.to_json())

    async def delete_rollout(self) -> None:
        await self._client.delete((CANARY_PREFIX + ROLLOUT).encode())

    async def nodes(self) -> dict[str, NodeInfo]:
        nodes, _ = await list_nodes(self._client)
        return nodes
