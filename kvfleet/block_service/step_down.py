"""When a leader that still holds its etcd lease steps down: no live node can reach it. Pure.

A leader cut off from the compute nodes but not from etcd keeps its lease, and with it every node's
block requests failing, for as long as the cut lasts. Nodes that cannot reach it say so in etcd
(``kvfleet.compute_service.blocks.complaint``: ``/kvfleet/block_service/unreachable/<node_id>`` = the
leader's address, under the node's lease), and the leader weighs what they say:

    not every live node complains about this leader (or none is registered) ──▶ keep leading
    every one does, and
        no standby is connected and caught up ───────────────────────────────▶ keep (none would take over)
        this replica took over less than the cool-down ago ──────────────────▶ keep (bounds flip-flops
                                                                                when no replica is reachable)
        otherwise ───────────────────────────────────────────────────────────▶ step down (resign: the
                                                                                standby campaigns at once)

One node that cannot reach the leader while another can is that node's trouble, not the leader's:
its requests fail over through the router as before. Stepping down is a resignation, so safety is
the election's: the lease is revoked only after ``holds()`` turned False.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KEEP, STEP_DOWN, NO_STANDBY, COOLING = "keep", "step_down", "no_standby", "cooling"
COOL_DOWN_TTLS = 3  # a replica that took over does not step down for this many lease TTLs


@dataclass(slots=True)
class Complaints:
    """The live nodes and what each says it cannot reach, as etcd lists them."""

    nodes: set[str] = field(default_factory=set)         # registered now (/kvfleet/nodes/<id>)
    against: dict[str, str] = field(default_factory=dict)  # node id -> the leader address it cannot reach

    def node(self, node_id: str, live: bool) -> None:
        (self.nodes.add if live else self.nodes.discard)(node_id)

    def complaint(self, node_id: str, leader: str | None) -> None:
        if leader is None:
            self.against.pop(node_id, None)
        else:
            self.against[node_id] = leader

    def all_against(self, leader: str) -> bool:
        """At least one node is live, and every live node says it cannot reach ``leader``."""
        return bool(self.nodes) and all(self.against.get(n) == leader for n in self.nodes)


@dataclass(slots=True, frozen=True)
class Verdict:
    action: str  # KEEP, STEP_DOWN, NO_STANDBY or COOLING (the last two: every node complains, yet it keeps)
    line: str    # why, for the log ("" when KEEP)


def decide(complaints: Complaints, me: str, standby_ready: bool, led_s: float, cool_down_s: float) -> Verdict:
    """What the leader at ``me`` does, having led for ``led_s`` seconds."""
    if not complaints.all_against(me):
        return Verdict(KEEP, "")
    unreached = f"none of the {len(complaints.nodes)} live nodes can reach it"
    if not standby_ready:
        return Verdict(NO_STANDBY, f"{unreached}, but no standby is caught up to take over: it keeps leading")
    if led_s < cool_down_s:
        return Verdict(COOLING, f"{unreached}, but it took over {led_s:.1f} s ago (cool-down {cool_down_s:.0f} s): "
                                "it keeps leading for now")
    return Verdict(STEP_DOWN, f"{unreached} (each has said so in etcd) and the standby is caught up")
