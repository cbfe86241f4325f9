"""Cluster membership in etcd: compute nodes announce themselves, the router watches.

Each node owns one key, ``/kvfleet/nodes/<node_id>``, attached to a lease of a few seconds that the
node keeps alive. A node that dies stops refreshing; etcd deletes its key when the lease expires and
every watcher sees the delete. The value is JSON::

    {"address": "127.0.0.1:7001", "model": "/models/x", "num_blocks": 512, "block_size": 256,
     "state": "READY", "max_num_seqs": 64, "role": "mixed", "group": "stable",
     "kv_rates": {"prefill_tokens_per_s": 9000.0, "copy_in_bytes_per_s": 2.4e10,
                  "fetch_bytes_per_s": 1.1e9, "bytes_per_token": 131072.0}}

``max_num_seqs`` is the node's live cap on running sequences (its ``--max-num-seqs``, or lower while
its P99 batch controller holds it down); routers without ``--capacity`` admit the sum of the READY
nodes' caps. 0 (a record written before the field existed): unknown, so no limit from that node.
``role`` (``kvfleet.core.roles``: mixed, prefill, decode; absent: mixed) is what the router may send it;
``group`` (``kvfleet.core.groups``; absent: stable) is the configuration it runs, for a canary;
``fetches_kv`` false (``--kv-fetch off``) tells the router a block only another node holds is a miss there.
``kv_rates`` (``kvfleet.core.kv_rates``: 0 = not measured) is what the node measured of its prefill, its
copies from its lower tiers and its fetches from other nodes; the router weighs its cost with them.
Absent (not measured yet, or an older node): the router's configured weights; malformed: the same,
with a warning, and the node stays listed.

States: WARMING (registered, not yet serving), READY (route to it), DRAINING (finishing its running
requests; route nothing new). The only etcd client is ``aetcd`` (two etcd client libraries clash on
``kv.proto``, so only one per process); an ``https://`` etcd is reached under mutual TLS
(``kvfleet.core.etcd_tls``), and its roles let a node write only its own key (``kvfleet.cli.etcd_auth``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import Enum

import aetcd

from kvfleet.core import tls
from kvfleet.core.backoff import LogThrottle, error_line
from kvfleet.core.etcd_endpoints import parse_endpoints
from kvfleet.core.etcd_failover import KEEPALIVE, FailoverClient
from kvfleet.core.etcd_tls import TlsClient
from kvfleet.core.etcd_watch import Listed, follow_prefix, raise_if_cancelled
from kvfleet.core.groups import STABLE, check_group
from kvfleet.core.kv_rates import KvRates
from kvfleet.core.roles import MIXED, check_role
from kvfleet.core.tls import Credentials

log = logging.getLogger(__name__)

NODES_PREFIX = "/kvfleet/nodes/"


class NodeState(str, Enum):
    WARMING = "WARMING"
    READY = "READY"
    DRAINING = "DRAINING"


@dataclass(slots=True, frozen=True)
class NodeInfo:
    node_id: str
    address: str
    model: str
    num_blocks: int
    block_size: int
    state: NodeState
    max_num_seqs: int = 0  # live cap on running sequences; 0: not published
    kv_rates: KvRates | None = None  # measured rates; None: not published
    role: str = MIXED                # kvfleet.core.roles: mixed, prefill or decode
    fetches_kv: bool = True          # it fetches prompts' KV from peers (--kv-fetch is not off)
    group: str = STABLE              # kvfleet.core.groups: the configuration it runs (stable, canary, ...)
    long_prefill_token_threshold: int = 0  # prompts with more tokens to compute yield to shorter ones; 0: off

    def to_json(self) -> bytes:
        fields = dataclasses.asdict(self)
        del fields["node_id"]  # it is the key
        fields["state"] = self.state.value
        if self.kv_rates is None:
            del fields["kv_rates"]  # a record as before the field existed
        else:
            fields["kv_rates"] = self.kv_rates.to_dict()
        return json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def from_json(cls, node_id: str, value: bytes) -> NodeInfo:
        fields = json.loads(value)
        return cls(
            node_id=node_id,
            address=str(fields["address"]),
            model=str(fields["model"]),
            num_blocks=int(fields["num_blocks"]),
            block_size=int(fields["block_size"]),
            state=NodeState(fields["state"]),
            max_num_seqs=int(fields.get("max_num_seqs", 0)),
            kv_rates=_kv_rates(node_id, fields.get("kv_rates")),
            role=check_role(fields.get("role", MIXED)),
            fetches_kv=bool(fields.get("fetches_kv", True)),
            group=check_group(fields.get("group", STABLE)),
            long_prefill_token_threshold=max(int(fields.get("long_prefill_token_threshold", 0)), 0),
        )


def _kv_rates(node_id: str, value: object) -> KvRates | None:
    """A node's published rates; a malformed entry costs the router only the measured weights."""
    if value is None:
        return None
    try:
        return KvRates.from_dict(value)
    except ValueError as e:
        log.warning("node %s publishes malformed kv_rates (%s); routing it with the configured weights",
                    node_id, e)
        return None


def node_key(node_id: str, prefix: str = NODES_PREFIX) -> bytes:
    if not node_id or "/" in node_id:
        raise ValueError(f"node id must be non-empty and contain no '/', got {node_id!r}")
    return (prefix + node_id).encode()


_warned_plain: set[str] = set()


def etcd_client(url: str, timeout: float | None = 5.0, credentials: Credentials | None = None) -> aetcd.Client:
    """An unconnected aetcd client over one etcd member or several (``http://a:2379,b:2379``; it
    moves to the next when one is unavailable: ``kvfleet.core.etcd_failover``): ``http://`` (or no
    scheme) in plaintext, ``https://`` under mutual TLS (``kvfleet.core.etcd_tls``) with
    ``credentials``, by default this process's (``kvfleet.core.tls.current()``); ValueError (one line)
    when there are none, or ``url`` is not a list of members (``kvfleet.core.etcd_endpoints``).

    One member is pinged too (``KEEPALIVE``, as several are): a watch only reads, so over a
    connection whose other end is gone (its RST lost on a lossy link, a host that vanished) it
    would wait forever on a key that changed long ago; the pings end it within ~9 s and the watch
    lists again (seen: every replica's leader watch stale after a lossy soak, nobody campaigning)."""
    endpoints = parse_endpoints(url)
    options = dict(KEEPALIVE)
    if not endpoints.tls:
        if (credentials or tls.current()) is not None and url not in _warned_plain:
            _warned_plain.add(url)  # the likely mistake: etcd serves TLS and the answer is "Socket closed"
            log.warning("etcd at %s in plaintext while this process has a certificate: if etcd serves TLS "
                        "(--client-cert-auth), give https://", url)
        return FailoverClient(endpoints, timeout=timeout, options=options)
    credentials = credentials or tls.current()
    if credentials is None:
        raise ValueError(f"etcd at {url} speaks TLS, and this process has no certificate (--certs DIR)")
    return TlsClient(endpoints, credentials, timeout=timeout, options=options)


class NodeRegistration:
    """One node's key under a lease that a background task keeps alive.

    If the lease is lost anyway (etcd restarted, the node stalled longer than the TTL), the
    keep-alive grants a new lease and writes the key again, so a node that is alive is listed.
    etcd down is never fatal: a node started while etcd is down registers once it answers, and a
    change of state that etcd could not take is written by the next keep-alive tick.
    """

    def __init__(self, client: aetcd.Client, info: NodeInfo, ttl: int = 5, prefix: str = NODES_PREFIX):
        if ttl < 2:
            raise ValueError(f"lease ttl must be >= 2 seconds, got {ttl}")
        self.client = client
        self.info = info
        self.ttl = ttl
        self.key = node_key(info.node_id, prefix)
        self.lease_id: int | None = None
        self._keepalive: asyncio.Task | None = None
        self._unwritten = False  # ``info`` changed while etcd could not take it

    async def start(self) -> None:
        """Register now if etcd answers, else as soon as it does (the keep-alive retries)."""
        try:
            await self._grant_and_put()
        except Exception as e:
            log.warning("node %s cannot register in etcd yet (%s); retrying", self.info.node_id, error_line(e))
        self._keepalive = asyncio.create_task(self._keep_alive(), name=f"lease-{self.info.node_id}")

    async def _grant_and_put(self) -> None:
        lease = await self.client.lease(self.ttl)
        self.lease_id = lease.id
        await self._put()

    async def _put(self) -> None:
        self._unwritten = True
        await self.client.put(self.key, self.info.to_json(), lease=self.lease_id)
        self._unwritten = False

    async def _keep_alive(self) -> None:
        interval = self.ttl / 3
        throttle = LogThrottle()  # etcd down: one line every few seconds, not one per tick
        failing = False
        while True:
            await asyncio.sleep(interval)
            try:
                if self.lease_id is None:  # never registered: etcd was down at the start
                    await self._grant_and_put()
                    log.info("node %s registered in etcd", self.info.node_id)
                else:
                    reply = await self.client.refresh_lease(self.lease_id)
                    if reply is None or reply.TTL <= 0:
                        log.warning("lease of node %s expired; registering again", self.info.node_id)
                        await self._grant_and_put()
                    elif self._unwritten:
                        await self._put()
                if failing:
                    log.info("lease keep-alive for node %s works again", self.info.node_id)
                    failing = False
            except asyncio.CancelledError:
                raise
            except Exception as e:  # etcd briefly unreachable: try again next tick
                raise_if_cancelled()  # a cancel the etcd client turned into its own exception
                failing = True
                if throttle.due():
                    log.warning("lease keep-alive for node %s failed: %s", self.info.node_id, error_line(e))

    async def update(self, **fields) -> None:
        """Change fields of the value (``state=NodeState.READY``, ``kv_rates=KvRates(...)``); with etcd
        down the change is written by the keep-alive once etcd answers."""
        self.info = dataclasses.replace(self.info, **fields)
        if self.lease_id is None:
            return  # the registration, when it comes, writes the latest value
        try:
            await self._put()
        except Exception as e:
            log.warning("node %s: etcd did not take its update (%s); the keep-alive writes it later",
                        self.info.node_id, error_line(e))

    async def set_state(self, state: NodeState) -> None:
        await self.update(state=state)

    async def close(self, revoke: bool = True) -> None:
        """Stop the keep-alive; with ``revoke`` the key disappears now instead of after the TTL."""
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
            self._keepalive = None
        if revoke and self.lease_id is not None:
            await self.client.revoke_lease(self.lease_id)
            self.lease_id = None


@dataclass(slots=True, frozen=True)
class MembershipChange:
    node_id: str
    info: NodeInfo | None  # None: the node left (key deleted or lease expired)
    listed: bool = False   # from a listing (the watcher's start or a resync), not a live event


async def list_nodes(client: aetcd.Client, prefix: str = NODES_PREFIX) -> tuple[dict[str, NodeInfo], int]:
    """The nodes listed now, and the etcd revision of that listing."""
    result = await client.get_prefix(prefix.encode())
    nodes: dict[str, NodeInfo] = {}
    for kv in result:
        node_id = kv.key.decode()[len(prefix):]
        info = _parse(node_id, kv.value)
        if info is not None:
            nodes[node_id] = info
    return nodes, result.header.revision


def _parse(node_id: str, value: bytes) -> NodeInfo | None:
    try:
        return NodeInfo.from_json(node_id, value)
    except (ValueError, KeyError, TypeError) as e:
        log.warning("ignoring malformed membership value for %s: %s", node_id, e)
        return None


async def watch_nodes(
    client: aetcd.Client, prefix: str = NODES_PREFIX, retry_s: float = 1.0
) -> AsyncIterator[MembershipChange]:
    """Every node listed now, then every change, forever.

    If the watch breaks (etcd restarted, history compacted), the listing is read again and the
    difference is yielded (``kvfleet.core.etcd_watch``), so the consumer's view converges without gaps.
    A value that does not parse is logged: listed, its node is not listed; in an event, passed over.
    """
    async for change in follow_prefix(client, prefix, f"membership {prefix}", retry_s):
        if isinstance(change, Listed):
            continue
        if change.value is None:
            yield MembershipChange(change.key, None, change.listed)
            continue
        info = _parse(change.key, change.value)
        if info is not None or change.listed:
            yield MembershipChange(change.key, info, change.listed)
