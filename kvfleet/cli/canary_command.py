"""``kvfleet canary``: a share of new conversations on the canary group, the numbers, the decision.

    kvfleet canary start --share 0.1 [--tenant T]   set (or change, while running) the split in etcd
    kvfleet canary stop                              share 0: every new conversation to stable
    kvfleet canary report [--json]                   per group figures with bootstrap intervals, verdicts
    kvfleet canary promote [--wait]                  every node restarted, one at a time, with the canary's config
    kvfleet canary rollback [--wait]                 the canary nodes restarted with the stable config

The split is one key in etcd (``kvfleet.core.canary``), written as the operator (``--certs``: the admin
certificate; etcd refuses any other identity). The report asks every router's metrics port for its
per-request outcomes (``/canary/samples``; default: the local cluster's router). Promote and
rollback are carried out by the supervisor of ``kvfleet up`` (``kvfleet.cli.canary_cluster``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request

from kvfleet.cli.cluster_certs import add_admin_flag, use_admin
from kvfleet.cli.cluster_state import ClusterState

ACTIONS = ("start", "stop", "report", "promote", "rollback")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=ACTIONS, help="what to do")
    parser.add_argument("--share", default=None, metavar="S", help="start: the canary's share of new conversations, "
                        "0..1")
    parser.add_argument("--tenant", default="", metavar="T", help="start: only this tenant's conversations")
    parser.add_argument("--etcd", default=None, metavar="URL", help="the cluster's etcd (default: the local "
                        "cluster's)")
    parser.add_argument("--router-metrics", action="append", default=[], metavar="URL",
                        help="report: a router's metrics base URL, http://host:port (repeatable: every replica; "
                             "default: the local cluster's router)")
    parser.add_argument("--json", action="store_true", help="report: one JSON object")
    parser.add_argument("--confidence", type=float, default=0.95, help="report: of the intervals (default 0.95)")
    parser.add_argument("--resamples", type=int, default=1000, help="report: bootstrap resamples (default 1000)")
    parser.add_argument("--seed", type=int, default=0, help="report: the bootstrap's seed (default 0)")
    parser.add_argument("--wait", action="store_true", help="promote/rollback: until every node is restarted")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="--wait: give up after this long")
    add_admin_flag(parser)


class Refused(Exception):
    """The command cannot do what was asked; the message is one line for the operator."""


async def _start(store, args) -> str:
    from kvfleet.core.canary import CanarySplit, check_share

    if args.share is None:
        raise Refused("start needs --share S (0..1)")
    try:
        share = check_share(args.share)
    except ValueError as e:
        raise Refused(str(e)) from None
    before = await store.split() or CanarySplit()
    if before.problem and share > 0:
        raise Refused(f"the canary group cannot serve, the split stays 0: {before.problem}")
    started = before.started_at if before.share > 0 else time.time()  # a change keeps the comparison going
    await store.put_split(CanarySplit(share, args.tenant, started, before.config_name, before.config_text))
    return f"canary split: {share:g} of new conversations{f' of tenant {args.tenant}' if args.tenant else ''}"


async def _stop(store, args) -> str:
    from dataclasses import replace

    before = await store.split()
    if before is None:
        return "no canary split was set"
    await store.put_split(replace(before, share=0.0))
    return "canary split: 0 (every new conversation to the stable group)"


async def _rollout(store, args) -> str:
    from kvfleet.core.canary import PROMOTE, Rollout
    from kvfleet.core.groups import CANARY
    from kvfleet.core.membership import NodeState

    split = await store.split()
    nodes = await store.nodes()
    canary = {n: info for n, info in nodes.items() if info.group == CANARY}
    if args.action == PROMOTE:
        if split is not None and split.problem:
            raise Refused(f"promote refused: the canary group is unhealthy: {split.problem}")
        unhealthy = sorted(n for n, info in canary.items() if info.state != NodeState.READY)
        if not canary or unhealthy:
            raise Refused("promote refused: the canary group is unhealthy: " +
                          (f"not READY: {', '.join(unhealthy)}" if unhealthy else "no canary node is listed"))
    await store.put_rollout(Rollout(args.action, split.config_text if split else "", time.time()))
    if not args.wait:
        return f"{args.action} requested: the supervisor restarts the nodes one at a time (its log says how far)"
    deadline = time.monotonic() + args.timeout_s
    while await store.rollout() is not None:
        if time.monotonic() > deadline:
            raise Refused(f"{args.action} not finished within {args.timeout_s:g}s")
        await asyncio.sleep(0.5)
    return f"{args.action} done"


def fetch_samples(urls: list[str], timeout_s: float = 10.0) -> list[dict]:
    """Every router's ``/canary/samples``."""
    bodies = []
    for url in urls:
        with urllib.request.urlopen(url.rstrip("/").removesuffix("/metrics") + "/canary/samples",
                                    timeout=timeout_s) as reply:
            bodies.append(json.loads(reply.read()))
    return bodies


def report(bodies: list[dict], confidence: float, resamples: int, seed: int, problem: str = "") -> dict:
    """The report as plain data: the split, each group's request count, a verdict per metric."""
    from kvfleet.cli.canary_verdict import compare, groups_from_samples
    from kvfleet.core.groups import CANARY, STABLE

    groups, info = groups_from_samples(bodies)
    verdicts = compare(groups[CANARY], groups[STABLE], confidence, resamples, seed)
    return {"split": info["split"], "ready_nodes": info["ready_nodes"], "problem": problem,
            "confidence": confidence, "requests": {g: groups[g].num_requests for g in (STABLE, CANARY)},
            "metrics": [{"metric": v.metric, "value": v.value, "interval": v.interval, "difference": v.difference,
                         "difference_interval": v.difference_interval, "threshold": v.threshold,
                         "relative": v.relative, "verdict": v.verdict} for v in verdicts]}


def render(data: dict) -> str:
    split = data["split"] or {}
    lines = [f"canary split: {split.get('share', 0):g}{' of tenant ' + split['tenant'] if split.get('tenant') else ''}"
             f"; requests stable {data['requests']['stable']}, canary {data['requests']['canary']}; ready nodes "
             f"{data['ready_nodes']}; intervals at {data['confidence']:g}"]
    if data["problem"]:
        lines.append(f"the canary serves nothing: {data['problem']}")
    lines.append(f"{'metric':<22} {'stable':>24} {'canary':>24} {'difference':>26}  verdict")
    for m in data["metrics"]:
        cell = lambda g: f"{m['value'][g]:.4g} [{m['interval'][g][0]:.3g}, {m['interval'][g][1]:.3g}]"  # noqa: E731
        lo, hi = m["difference_interval"]
        difference = (f"{m['difference']:+.1%} [{lo:+.1%}, {hi:+.1%}]" if m["relative"] else
                      f"{m['difference']:+.3g} [{lo:+.3g}, {hi:+.3g}]")
        lines.append(f"{m['metric']:<22} {cell('stable'):>24} {cell('canary'):>24} {difference:>26}  {m['verdict']}")
    return "\n".join(lines)


async def _run(args, credentials) -> str:
    from kvfleet.cli.canary_etcd import CanaryStore

    async with CanaryStore(args.etcd, credentials) as store:
        if args.action == "start":
            return await _start(store, args)
        if args.action == "stop":
            return await _stop(store, args)
        if args.action == "report":
            split = await store.split()
            data = report(fetch_samples(args.router_metrics), args.confidence, args.resamples, args.seed,
                          split.problem if split else "")
            return json.dumps(data) if args.json else render(data)
        return await _rollout(store, args)


def run(args: argparse.Namespace) -> int:
    from kvfleet.core.backoff import error_line

    state = ClusterState.read()
    args.etcd = args.etcd or (state.etcd if state is not None else None)
    if not args.router_metrics and state is not None and state.router_metrics:
        args.router_metrics = [state.router_metrics]
    if args.etcd is None:
        print("kvfleet canary: no cluster: give --etcd URL (no local cluster runs)", file=sys.stderr)
        return 2
    if args.action == "report" and not args.router_metrics:
        print("kvfleet canary: report needs --router-metrics URL (no local cluster runs)", file=sys.stderr)
        return 2
    try:
        credentials = use_admin(args.certs, state.certs if state is not None else None)
        print(asyncio.run(_run(args, credentials)))
    except Refused as e:
        print(f"kvfleet canary: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - etcd or a router refused or is away: one line
        print(f"kvfleet canary {args.action}: {error_line(e)}", file=sys.stderr)
        return 1
    return 0
