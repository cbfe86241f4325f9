"""The router's canary: the split it follows in etcd, and the outcomes it records per group.

Every router replica follows ``/kvfleet/canary/split`` (``kvfleet.core.canary``), so all agree on the
share and a restarted router reads it back; a change takes effect for the next new request, with no
restart. A split with a new ``started_at`` starts a new comparison: the outcomes recorded before it
are forgotten. A value that does not parse leaves the split as it was (logged).
"""

from __future__ import annotations

import logging

from kvfleet.core.backoff import error_line
from kvfleet.core.canary import CANARY_PREFIX, SPLIT, CanarySplit
from kvfleet.core.etcd_watch import Listed, follow_prefix
from kvfleet.core.groups import side
from kvfleet.router.canary_samples import GroupSamples, Outcome, OutcomeTimer
from kvfleet.router.canary_split import assign

log = logging.getLogger(__name__)


class CanaryRouting:
    def __init__(self, samples: GroupSamples | None = None):
        self.split: CanarySplit | None = None
        self.samples = samples or GroupSamples()

    def group_for(self, tenant: str, key: bytes) -> str:
        return assign(self.split, tenant, key)

    def timer(self, group: str) -> OutcomeTimer:
        return OutcomeTimer(group)

    def record(self, outcome: Outcome) -> None:
        """Keep ``outcome`` for the comparison under way; with no split there is none (a split that
        starts clears what came before), so nothing is kept and the rings stay empty."""
        if self.split is not None:
            self.samples.add(outcome)

    def set_split(self, split: CanarySplit | None) -> None:
        before = self.split
        if split is not None and (before is None or before.started_at != split.started_at):
            self.samples.clear()
        self.split = split
        if split is None:
            log.info("canary split removed: every conversation to the stable group")
        else:
            log.info("canary split: %g of new conversations%s to the canary group%s", split.share,
                     f" of tenant {split.tenant}" if split.tenant else "",
                     f" ({split.problem})" if split.problem else "")

    def apply(self, key: str, value: bytes | None) -> None:
        """One change under ``/kvfleet/canary/`` (the key without the prefix)."""
        if key != SPLIT:
            return
        if value is None:
            self.set_split(None)
            return
        try:
            self.set_split(CanarySplit.from_json(value))
        except ValueError as e:
            log.warning("ignoring a malformed canary split in etcd (%s); keeping the one before", error_line(e))

    async def follow(self, client) -> None:
        """Follow the split in etcd forever (a task of the router's)."""
        async for change in follow_prefix(client, CANARY_PREFIX, "canary split"):
            if not isinstance(change, Listed):
                self.apply(change.key, change.value)

    def samples_json(self, ready_groups: list[str]) -> dict:
        """What ``/canary/samples`` serves: the split, the READY nodes per side, each group's outcomes."""
        nodes: dict[str, int] = {}
        for group in ready_groups:
            nodes[side(group)] = nodes.get(side(group), 0) + 1
        split = self.split
        return self.samples.to_json(split=None if split is None else {
            "share": split.share, "tenant": split.tenant, "started_at": split.started_at,
            "config_name": split.config_name, "problem": split.problem}, ready_nodes=nodes)
