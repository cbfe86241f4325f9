"""The router's view of the compute nodes: membership from etcd, a channel per node, in-flight load.

A node is routable while it is READY in etcd. A node whose key goes (its lease lapsed: etcd was
down or frozen, the node stalled) is no longer routed to, but its Serve stream stays open while
this router's requests on it run: a lapsed lease is not a death (a dead node's stream breaks, and
that fails its requests over), and hanging up would fail over streams that were fine, or fail
them outright when every node's lease lapsed at once. If the node comes back at the same address
it keeps that stream; otherwise the stream closes when its last request ends. ``ready_since`` is when the router saw it turn READY
(the start of its cold-start ramp); nodes already READY in the router's first listing count as
warm. Load is the router's own count of the blocks its in-flight requests hold on each node, kept
current as tokens stream, so it needs no polling and has no lag.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfleet.core.kv_rates import lower_tier_weight, peer_weight
from kvfleet.core.membership import MembershipChange, NodeInfo, NodeState
from kvfleet.router.node_stream import Inbox
from kvfleet.router.routing import NO_HIT, NodeLoad, PrefixHit
from kvfleet.v1 import compute_pb2

log = logging.getLogger(__name__)

# address → (channel, the node's Serve stream); both have an async close()
Dial = Callable[[str], tuple[Any, Any]]


@dataclass(slots=True)
class RouterNode:
    info: NodeInfo
    channel: Any                       # the gRPC channel to the node (made by the table's ``dial``)
    stream: Any                        # the router's Serve stream to it (kvfleet.router.node_stream.NodeStream)
    ready_since: float | None = None   # None: not READY
    active_blocks: int = 0             # blocks this router's in-flight requests added there (``start``)
    prefill_blocks: int = 0            # of those, the blocks of requests with no token yet: prefill ahead
    long_prefill_blocks: int = 0       # of those, the blocks of prompts past the node's long-prefill threshold
    num_in_flight: int = 0
    num_routed: int = 0                # requests sent here since it joined
    failed_at: float | None = None     # last time a call to it failed (cleared by a READY update)
    _blocks_of: dict[str, int] = field(default_factory=dict)  # seq id → blocks it counts for here
    _found_of: dict[str, int] = field(default_factory=dict)   # seq id → prefix blocks it found cached here
    _decoding: set[str] = field(default_factory=set)  # seq ids that have had a token: past their prefill
    _long: set[str] = field(default_factory=set)      # seq ids prefilling a long prompt (``is_long``)

    @property
    def node_id(self) -> str:
        return self.info.node_id

    def load(self, hit: PrefixHit = NO_HIT) -> NodeLoad:
        """What the picker weighs of this node for a prompt it holds ``hit`` of: its load, and the
        weights of its lower-tier and fetched blocks from the rates it publishes (``kvfleet.core.kv_rates``)."""
        rates = self.info.kv_rates
        fetched = peer_weight(rates) if self.info.fetches_kv else 0.0  # a node that never fetches: a miss
        return NodeLoad(self.node_id, self.active_blocks, hit.hot, self.ready_since, hit.lower, self.prefill_blocks,
                        hit.peer, lower_tier_weight(rates), fetched, self.long_prefill_blocks,
                        self.threshold_blocks())

    def threshold_blocks(self) -> int:
        """The node's long-prefill threshold in whole blocks (0: it lets no prompt first)."""
        size = self.info.block_size
        return self.info.long_prefill_token_threshold // size if size > 0 else 0

    def is_long(self, num_tokens: int, found_blocks: int) -> bool:
        """Whether a prompt of ``num_tokens`` that found ``found_blocks`` cached here is long for the
        node: more tokens to compute than its threshold (the node's own test, the scheduler's)."""
        threshold = self.info.long_prefill_token_threshold
        return threshold > 0 and num_tokens - found_blocks * self.info.block_size > threshold

    def full_blocks(self, num_tokens: int) -> int:
        """How many whole blocks of this node ``num_tokens`` tokens fill."""
        return num_tokens // self.info.block_size

    def start(self, seq_id: str, request: compute_pb2.ComputeRequest, cached_blocks: int = 0) -> Inbox:
        """Send an attempt at ``seq_id`` on this node's stream; it counts in flight (and its blocks
        as held here) until ``finish``. Its events arrive in the returned inbox.

        Only the blocks past the ``cached_blocks`` leading ones it was routed here for count: those
        are on the node already, held once however many requests read them, and cost no prefill.
        Counted in full, a shared system prompt or a conversation's history would make the node
        that holds it look busier with every request sent there for it, and push the next one away."""
        self._found_of[seq_id] = cached_blocks
        self.hold_seq(seq_id, len(request.prompt_token_ids))
        self.num_in_flight += 1
        self.num_routed += 1
        return self.stream.start(request)

    def finish(self, seq_id: str, request_id: str, cancel: bool) -> None:
        """The attempt ``request_id`` at ``seq_id`` is over for the router; with ``cancel`` the node
        is told to abort it (the client left, or the node went silent)."""
        self.stream.finish(request_id, cancel=cancel)
        self.drop_seq(seq_id)
        self.num_in_flight -= 1

    def hold_seq(self, seq_id: str, num_tokens: int, decoding: bool = False) -> None:
        """Record that sequence ``seq_id`` holds ``num_tokens`` tokens of KV on this node; ``decoding``
        once a token of it came back (its prefill is done: no longer work ahead of a new prompt)."""
        found = self._found_of.get(seq_id, 0)
        blocks = max(-(-num_tokens // self.info.block_size) - found, 0)
        self._forget(seq_id)
        self._blocks_of[seq_id] = blocks
        self.active_blocks += blocks
        if decoding:
            self._decoding.add(seq_id)
        else:
            self.prefill_blocks += blocks
            if self.is_long(num_tokens, found):
                self._long.add(seq_id)
                self.long_prefill_blocks += blocks

    def drop_seq(self, seq_id: str) -> None:
        """Sequence ``seq_id`` holds nothing on this node any more (its attempt here is over)."""
        self._forget(seq_id)
        self._found_of.pop(seq_id, None)

    def _forget(self, seq_id: str) -> None:
        blocks = self._blocks_of.pop(seq_id, 0)
        self.active_blocks -= blocks
        if seq_id in self._decoding:
            self._decoding.discard(seq_id)
        else:
            self.prefill_blocks -= blocks
            if seq_id in self._long:
                self._long.discard(seq_id)
                self.long_prefill_blocks -= blocks


class NodeTable:
    def __init__(self, dial: Dial, clock: Callable[[], float] = time.monotonic, failure_quarantine_s: float = 2.0):
        self.dial = dial
        self.clock = clock
        self.failure_quarantine_s = failure_quarantine_s
        self.nodes: dict[str, RouterNode] = {}
        self.departed: dict[str, RouterNode] = {}  # left etcd, requests still in flight on them
        self._closing: set[asyncio.Task] = set()

    async def apply(self, change: MembershipChange) -> None:
        node = self.nodes.get(change.node_id)
        info = change.info
        if info is not None and not info.address:
            info = None  # registered before it could say where it listens: not a node to dial yet
        if info is None or (node is not None and node.info.address != info.address):
            if node is not None:
                del self.nodes[change.node_id]
                await self._depart(node, moved=info is not None)
            node = None
        if info is not None:
            if node is None:
                node = self._come_back(info)
            if node is None:
                node = RouterNode(info, *self.dial(info.address, info.node_id))
                self.nodes[info.node_id] = node
            was_ready = node.ready_since is not None
            node.info = info
            if info.state == NodeState.READY:
                node.failed_at = None
                if not was_ready:
                    # A node already READY when the router starts is not cold: no ramp for it.
                    node.ready_since = float("-inf") if change.listed else self.clock()
                    log.info("node %s READY at %s (%d blocks of %d)", info.node_id, info.address,
                             info.num_blocks, info.block_size)
            else:
                node.ready_since = None

    async def _depart(self, node: RouterNode, moved: bool) -> None:
        earlier = self.departed.pop(node.node_id, None)
        if earlier is not None:
            await self._hang_up(earlier)
        if moved or not node.num_in_flight:
            log.info("node %s left (%s)", node.node_id, "moved" if moved else "lease gone or no address")
            await self._hang_up(node)
            return
        log.info("node %s left etcd (lease gone); its stream stays open for %d requests in flight",
                 node.node_id, node.num_in_flight)
        self.departed[node.node_id] = node

    def _come_back(self, info: NodeInfo) -> RouterNode | None:
        """A departed node listed again at the same address: the same stream serves it."""
        node = self.departed.get(info.node_id)
        if node is None or node.info.address != info.address:
            return None
        del self.departed[info.node_id]
        self.nodes[info.node_id] = node
        log.info("node %s is back in etcd; its stream was kept", info.node_id)
        return node

    def get(self, node_id: str) -> RouterNode:
        return self.nodes[node_id]

    def finish(self, node: RouterNode, seq_id: str, request_id: str, cancel: bool) -> None:
        """``RouterNode.finish``, and a departed node's stream closes with its last request."""
        node.finish(seq_id, request_id, cancel)
        if node.num_in_flight == 0 and self.departed.get(node.node_id) is node:
            del self.departed[node.node_id]
            log.info("node %s: last request over; closing its stream", node.node_id)
            task = asyncio.get_running_loop().create_task(self._hang_up(node))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def mark_failed(self, node_id: str) -> None:
        """A call to the node broke: keep it out of routing for a while, or until etcd says READY
        again (a dead node's lease will expire and remove it)."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.failed_at = self.clock()

    def ready(self) -> list[RouterNode]:
        now = self.clock()
        return [
            n for n in self.nodes.values()
            if n.ready_since is not None
            and (n.failed_at is None or now - n.failed_at > self.failure_quarantine_s)
        ]

    def capacity(self) -> int | None:
        """Requests the fleet runs at once: the sum of the READY nodes' live caps (their membership
        records' ``max_num_seqs``). None (no limit) when no node is READY, so that a request is not
        held in the queue but answered UNAVAILABLE as before, or when a READY node publishes no cap."""
        caps = [n.info.max_num_seqs for n in self.nodes.values() if n.ready_since is not None]
        if not caps or 0 in caps:
            return None
        return sum(caps)

    async def close(self) -> None:
        for node in [*self.nodes.values(), *self.departed.values()]:
            await self._hang_up(node)
        self.nodes.clear()
        self.departed.clear()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    @staticmethod
    async def _hang_up(node: RouterNode) -> None:
        await node.stream.close()  # its requests fail over to other nodes
        await node.channel.close()
