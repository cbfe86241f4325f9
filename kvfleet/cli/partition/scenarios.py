"""The partition scenarios, each a fault injected into a running ``BedCluster`` while the clients of
``history`` record, then healed; ``run_scenario`` returns the checker's figures for it.

Every scenario names its parts by role at the time it starts (the leader may be either replica):

- ``leader_isolated``: the leader cut off from etcd and the standby, still reachable by the nodes;
- ``leader_cut_from_nodes``: the leader cut off from the nodes (and the router) only;
- ``node_cut_from_router``: node-0 cut off from the router only;
- ``node_cut_from_block_service``: node-0 cut off from both replicas;
- ``node_cut_from_etcd``: node-0 cut off from etcd only (its lease lapses; it still serves);
- ``etcd_unreachable``: etcd cut off from every service for longer than a lease;
- ``one_way_leader_to_etcd``: the leader's packets to etcd dropped, etcd's to it delivered;
- ``one_way_standby_lagging``: the same cut while the standby is stalled (SIGSTOP) from 2.4 s before
  it until after the lease lapsed: the leader acknowledges alone (out of sync) before it fences, and
  the standby must apply those records before it takes over (issue 34's double grant);
- ``lossy``: 10 % of every service's packets dropped and what each sends delayed 200 ms ± 100 ms
  (``tc netem``, or ``delay_proxy`` where the kernel has no netem) for the soak time.

Those run on a bed whose etcd is one member (``etcd``). ``ETCD_MEMBER_SCENARIOS`` need three
(``BedCluster(..., etcd_members=3)``: ``etcd-0``..``etcd-2``), so they are not in ``SCENARIOS``:

- ``etcd_member_cut_off``: the member every service and client starts on (the first of ``--etcd``)
  cut off from everyone, its peers and the clients included, for three lease TTLs.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvfleet.cli.partition.bed_cluster import NODES, REPLICAS, SERVICES, BedCluster
from kvfleet.cli.partition.checker import check, history_json
from kvfleet.cli.partition.history import PageTableClient, QuotaSampler, StreamClients

MAX_TOKENS = 16  # each stream's greedy tokens (the tests'; the bench takes its own)
_RUNS = itertools.count()  # each run's sequence ids are its own, also when a scenario repeats


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    inject: Callable[[BedCluster, str, str], None]  # (cluster, leader, standby)
    hold_s: float                                   # how long the fault lasts, in lease TTLs
    soak: bool = False                              # hold for the run's soak time instead
    delay_ms: int = 0                               # the delay it adds to what every service sends


def _leader_isolated(c: BedCluster, leader: str, standby: str) -> None:
    c.bed.isolate(leader, "etcd", standby)


def _leader_cut_from_nodes(c: BedCluster, leader: str, standby: str) -> None:
    c.bed.isolate(leader, *NODES, "router")


def _node_cut_from_router(c: BedCluster, leader: str, standby: str) -> None:
    c.bed.cut("node-0", "router")


def _node_cut_from_block_service(c: BedCluster, leader: str, standby: str) -> None:
    c.bed.isolate("node-0", *REPLICAS)


def _node_cut_from_etcd(c: BedCluster, leader: str, standby: str) -> None:
    c.bed.cut("node-0", "etcd")


def _etcd_unreachable(c: BedCluster, leader: str, standby: str) -> None:
    c.bed.isolate("etcd", *(s for s in SERVICES if s != "etcd"))


def _one_way_leader_to_etcd(c: BedCluster, leader: str, standby: str) -> None:
    c.bed.cut(leader, "etcd", one_way=True)


def _one_way_standby_lagging(c: BedCluster, leader: str, standby: str) -> None:
    pid = c.child(standby).process.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.4)  # past the leader's wait for the standby (--sync-timeout 2 s): it acknowledges alone
        c.bed.cut(leader, "etcd", one_way=True)
        time.sleep(1.5 * c.lease_ttl_s)  # the leader fences at TTL/2, its lease lapses at TTL
    finally:
        os.kill(pid, signal.SIGCONT)


LOSSY_LOSS_PCT, LOSSY_DELAY_MS, LOSSY_JITTER_MS = 10.0, 200, 100


def _lossy(c: BedCluster, leader: str, standby: str) -> None:
    # tc netem, or the delay proxies where the kernel has no netem: every service's at one moment
    c.bed.delay_every(SERVICES, LOSSY_DELAY_MS, LOSSY_JITTER_MS)
    for s in SERVICES:
        c.bed.loss(s, None, LOSSY_LOSS_PCT)


def _etcd_member_cut_off(c: BedCluster, leader: str, standby: str) -> None:
    first = c.etcd_names[0]
    c.bed.isolate(first, *(s for s in c.services if s != first), "client")


SCENARIOS = {s.name: s for s in [
    Scenario("leader_isolated", _leader_isolated, 3.0),
    Scenario("node_cut_from_router", _node_cut_from_router, 3.0),
    Scenario("one_way_leader_to_etcd", _one_way_leader_to_etcd, 3.0),
    Scenario("one_way_standby_lagging", _one_way_standby_lagging, 1.0),
    Scenario("leader_cut_from_nodes", _leader_cut_from_nodes, 3.0),
    Scenario("node_cut_from_block_service", _node_cut_from_block_service, 3.0),
    Scenario("node_cut_from_etcd", _node_cut_from_etcd, 3.0),
    Scenario("etcd_unreachable", _etcd_unreachable, 2.5),
    Scenario("lossy", _lossy, 0.0, soak=True, delay_ms=LOSSY_DELAY_MS),
]}
ETCD_MEMBER_SCENARIOS = {s.name: s for s in [
    Scenario("etcd_member_cut_off", _etcd_member_cut_off, 3.0),
]}


def prompts(n: int = 4, length: int = 20, seed: int = 7) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


class Traffic:
    """The clients of one scenario, started together and stopped together."""

    def __init__(self, cluster: BedCluster, prefix: str, prompt_list: list[list[int]], max_tokens: int) -> None:
        self.page_table = PageTableClient(cluster, prefix=prefix)
        self.streams = StreamClients(cluster.router_address, prompt_list, max_tokens)
        self.quota = QuotaSampler(cluster)

    def start(self) -> None:
        self.page_table.start()
        self.streams.start()
        self.quota.start()

    def stop(self) -> None:
        self.streams.stop()
        self.page_table.stop()
        self.quota.stop()
        if self.page_table.error is not None:
            raise RuntimeError(f"the page-table client failed: {self.page_table.error}")


def wait_recovered(cluster: BedCluster, timeout_s: float = 90.0) -> None:
    """Until a leader is named, both nodes are READY and the router serves."""
    deadline = time.monotonic() + timeout_s
    cluster.wait_leader(timeout=timeout_s)
    cluster.wait_ready(list(NODES), max(deadline - time.monotonic(), 1.0))
    cluster.wait_router(max(deadline - time.monotonic(), 1.0))


def run_scenario(cluster: BedCluster, scenario: Scenario, reference: dict[int, list[int]],
                 prompt_list: list[list[int]], max_tokens: int, soak_s: float = 30.0,
                 settle_s: float = 3.0, history_dir: Path | None = None) -> dict:
    """Traffic, the fault for its hold time, the heal, traffic until the cluster serves again and a
    little after; then the checker's figures, the faults and the leader before and after. With
    ``history_dir``, the whole history is saved there as ``<scenario>-<run>.json`` (``result["history"]``)."""
    wait_recovered(cluster)
    leader = cluster.wait_leader()
    standby = next(r for r in REPLICAS if r != leader)
    run = next(_RUNS)
    traffic = Traffic(cluster, f"{scenario.name[:6]}{run}-", prompt_list, max_tokens)
    traffic.start()
    began = time.monotonic()
    try:
        time.sleep(settle_s)
        start = len(cluster.bed.faults)
        injected_at = time.monotonic()
        scenario.inject(cluster, leader, standby)
        time.sleep(soak_s if scenario.soak else scenario.hold_s * cluster.lease_ttl_s)
        cluster.bed.heal()
        healed_at = time.monotonic()
        wait_recovered(cluster)
        recovered_s = time.monotonic() - healed_at
        time.sleep(settle_s)
    finally:
        cluster.bed.heal()
        ended = time.monotonic()
        traffic.stop()
    final = traffic.page_table.final_state()
    traffic.page_table.release_all(sorted(final))
    result = check(traffic.page_table.writes, final, traffic.streams.streams, reference, traffic.quota.samples, began, ended,
                   delay_s=scenario.delay_ms / 1000)
    result.update(faults=cluster.bed.faults[start:], leader_before=leader, leader_after=cluster.leader(),
                  recovered_after_heal_s=round(recovered_s, 2), exited=cluster.exited(),
                  refused_allocations=traffic.page_table.refusals,
                  injected_at_s=round(injected_at - began, 3), healed_at_s=round(healed_at - began, 3))
    if history_dir is not None:
        path = Path(history_dir) / f"{scenario.name}-{run}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {k: result[k] for k in ("faults", "leader_before", "leader_after", "injected_at_s", "healed_at_s",
                                       "stall_s")}
        path.write_text(json.dumps(history_json(traffic.page_table.writes, final, traffic.streams.streams,
                                                traffic.quota.samples, began, ended, scenario=scenario.name, **meta)))
        result["history"] = str(path)
    return result
