"""Where block_service's leader is: one etcd key, for everyone who talks to block_service.

Two (or more) block_service replicas elect a leader through etcd (``kvfleet.block_service.election``): the
winner holds ``/kvfleet/block_service/leader`` under its lease, the value JSON
``{"address": "10.0.0.5:50051", "lineage": "<state lineage id>", "ttl_s": 5}``. Compute nodes, the
router and the standbys follow that key (``watch_leader``) and reconnect when it names another
address; the key is absent while no replica leads (between a leader's lease lapsing and the next
one winning).

A node that has not reached the leader for half its TTL says so under ``UNREACHABLE_PREFIX``:
``/kvfleet/block_service/unreachable/<node_id>`` = the leader's address, under the node's own lease
(``kvfleet.compute_service.blocks.complaint``); a leader every live node says so of steps down
(``kvfleet.block_service.step_down``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

import aetcd

from kvfleet.core.etcd_watch import Change, follow_prefix

log = logging.getLogger(__name__)

LEADER_KEY = "/kvfleet/block_service/leader"
FROM_ETCD = "etcd"  # ``--block-service etcd``: no fixed address, the leader named by LEADER_KEY
UNREACHABLE_PREFIX = "/kvfleet/block_service/unreachable/"


@dataclass(slots=True, frozen=True)
class Leader:
    address: str   # host:port its BlockManager answers on
    lineage: str   # its state directory's lineage (kvfleet.block_service.lineage)
    ttl_s: int = 0  # its lease's TTL; 0: not said (a replica older than the field)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, value: bytes) -> Leader:
        fields = json.loads(value)
        return cls(str(fields["address"]), str(fields["lineage"]), int(fields.get("ttl_s", 0)))


def unreachable_key(node_id: str) -> bytes:
    """Where node ``node_id`` says which leader it cannot reach (``kvfleet.cli.etcd_auth`` lets it
    write this key and its registration, nothing else)."""
    from kvfleet.core.membership import node_key

    return node_key(node_id, UNREACHABLE_PREFIX)


def _parse(value: bytes) -> Leader | None:
    try:
        return Leader.from_json(value)
    except (ValueError, KeyError, TypeError) as e:
        log.warning("ignoring a malformed block_service leader value %r: %s", value[:80], e)
        return None


async def read_leader(client: aetcd.Client, key: str = LEADER_KEY) -> tuple[Leader | None, int]:
    """The leader named now (None: no replica leads), and the etcd revision of that read."""
    result = await client.get_prefix(key.encode())
    found = next((kv for kv in result if kv.key == key.encode()), None)
    return (_parse(found.value) if found is not None else None), result.header.revision


async def leader_address(etcd_url: str, timeout_s: float = 5.0, credentials=None) -> str | None:
    """The address of the leader the etcd at ``etcd_url`` names now (None: none leads), read once
    (over TLS: as ``credentials``, else this process's)."""
    from kvfleet.core.membership import etcd_client

    async with etcd_client(etcd_url, credentials=credentials) as client:
        leader, _ = await asyncio.wait_for(read_leader(client), timeout_s)
    return leader.address if leader else None


async def watch_leader(client: aetcd.Client, key: str = LEADER_KEY, retry_s: float = 1.0
                       ) -> AsyncIterator[Leader | None]:
    """The leader named now, then each change (None while nobody leads), forever; a broken watch
    (etcd restarted) reads the key again (``kvfleet.core.etcd_watch``), so no change is missed for long."""
    last: object = object()
    leader: Leader | None = None
    async for change in follow_prefix(client, key, "the block_service leader", retry_s):
        if isinstance(change, Change):
            if change.key != "":
                continue  # a longer key that shares the prefix
            leader = _parse(change.value) if change.value is not None else None
            if change.listed:
                continue  # yielded once the listing is complete
        if leader != last:
            last = leader
            yield leader
