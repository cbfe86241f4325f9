"""``kvfleet up --canary-config FILE --canary-nodes N``: N of the local cluster's nodes run another
configuration (group ``canary``), and the supervisor carries out ``kvfleet canary promote`` and
``rollback``.

    start     the stable nodes as always; then the canary nodes, from FILE's values over the cluster's
              own (the format of ``kvfleet up --config``, what ``kvfleet tune`` writes), ``--group canary``;
              a FILE that does not load, or a canary node that does not become READY: no canary node
              runs, the cluster serves on stable, and the split in etcd says why (share 0, ``problem``)
    promote   each stable node in turn drained (SIGTERM: it finishes its requests, routes nothing new),
              then started again with the canary's configuration; then each canary node in turn, into
              the stable group; the canary's configuration is the cluster's from then on
    rollback  each canary node in turn drained and started again with the stable configuration, into
              the stable group

One node at a time, each READY before the next goes, so the others serve meanwhile; a request that a
drain cannot finish is resumed elsewhere as for any node that goes (``kvfleet/router/relay.py``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from kvfleet.cli.local_cluster import LocalCluster
from kvfleet.compute_service.node.settings import NodeSettings
from kvfleet.core import settings
from kvfleet.core.backoff import error_line
from kvfleet.core.canary import PROMOTE, CanarySplit
from kvfleet.core.groups import CANARY, STABLE

log = logging.getLogger(__name__)
CHECK_EVERY_S = 1.0


@dataclass(slots=True)
class CanaryPlan:
    config_name: str
    config_text: str
    node: NodeSettings | None  # None: the file did not load
    problem: str = ""

    @classmethod
    def load(cls, path: str, schema: type, base: dict) -> CanaryPlan:
        """The canary's node settings: ``path``'s values (``schema``'s keys) over ``base`` (the cluster's)."""
        from kvfleet.cli.config_file import load

        try:
            text = Path(path).read_text()
        except OSError as e:
            return cls(path, "", None, f"cannot read the canary config {path}: {e.strerror or e}")
        try:
            values = load(path, schema)
            return cls(path, text, settings.build(schema, {**base, **values}).node)
        except ValueError as e:
            return cls(path, text, None, f"the canary config does not load: {e}")


class CanaryNodes:
    """The canary nodes of ``cluster`` (``node_ids``), and the rollouts etcd asks for."""

    def __init__(self, cluster: LocalCluster, plan: CanaryPlan, node_ids: list[str]):
        self.cluster, self.plan, self.node_ids = cluster, plan, list(node_ids)
        self._checked = 0.0

    def start(self, timeout: float) -> None:
        """Start the canary nodes (none when the plan has a problem); the split says how it went."""
        if self.plan.node is not None:
            try:
                for node_id in self.node_ids:
                    self._add(node_id, self.plan.node, CANARY, wait=False)
                self.cluster.wait_ready(self.node_ids, timeout)
            except (RuntimeError, TimeoutError) as e:
                first = str(e).splitlines()[0]
                self.plan.problem = f"the canary nodes did not start: {first}"
                for node_id in self.node_ids:
                    self._stop(node_id)
        if self.plan.problem:
            log.error("canary: %s; serving on the stable group", self.plan.problem)
        self._write(CanarySplit(0.0, "", 0.0, self.plan.config_name, self.plan.config_text, self.plan.problem))

    def _add(self, node_id: str, node: NodeSettings, group: str, wait: bool = True) -> None:
        stable, self.cluster.node = self.cluster.node, node  # add_node takes the cluster's settings
        try:
            self.cluster.add_node(node_id, wait=wait, extra=("--group", group))
        finally:
            self.cluster.node = stable

    def _stop(self, node_id: str) -> None:
        """Drain ``node_id`` (SIGTERM) and wait until it is gone; it leaves the cluster's children."""
        child = self.cluster.nodes.pop(node_id, None)
        if child is None or child.process is None:
            return
        if child.alive():
            child.process.send_signal(signal.SIGTERM)
        try:
            child.process.wait(self.cluster.node.drain_timeout + 30)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()

    def _write(self, split: CanarySplit) -> None:
        from kvfleet.cli.canary_etcd import CanaryStore

        async def write() -> None:
            async with CanaryStore(self.cluster.etcd.url) as store:
                await store.put_split(split)

        asyncio.run(write())

    def poll(self) -> None:
        """Carry out a rollout etcd asks for (at most one look per ``CHECK_EVERY_S``)."""
        if time.monotonic() - self._checked < CHECK_EVERY_S:
            return
        self._checked = time.monotonic()
        from kvfleet.cli.canary_etcd import CanaryStore

        async def read():
            async with CanaryStore(self.cluster.etcd.url) as store:
                return await store.rollout(), await store.split()

        try:
            rollout, split = asyncio.run(read())
        except Exception as e:  # noqa: BLE001 - etcd away: the next look
            log.warning("canary: cannot read the rollout key: %s", error_line(e))
            return
        if rollout is not None:
            self.carry_out(rollout.action, split or CanarySplit())

    def carry_out(self, action: str, split: CanarySplit) -> None:
        canary = [n for n in self.node_ids if n in self.cluster.nodes]
        stable = [n for n in self.cluster.nodes if n not in canary]
        if action == PROMOTE and self.plan.node is not None:
            new = self.plan.node
            order = stable + canary
        else:
            new, order = self.cluster.node, canary
        log.warning("canary %s: restarting %s one at a time", action, ", ".join(order) or "no node")
        try:
            for node_id in order:
                self._stop(node_id)
                self._add(node_id, new, STABLE)
                log.warning("canary %s: %s READY again", action, node_id)
        except (RuntimeError, TimeoutError) as e:  # the supervisor restarts it with the cluster's config
            log.error("canary %s stopped: %s", action, str(e).splitlines()[0])
            new = self.cluster.node
        self.cluster.node = new
        self.node_ids = []
        from kvfleet.cli.canary_etcd import CanaryStore

        async def done() -> None:
            async with CanaryStore(self.cluster.etcd.url) as store:
                await store.put_split(replace(split, share=0.0, problem=""))
                await store.delete_rollout()

        asyncio.run(done())
        log.warning("canary %s done", action)
