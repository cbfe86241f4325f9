"""``kvfleet blocks``: who holds the KV blocks, asked of block_service (read-only).

    kvfleet blocks [--block-service ADDR] [--etcd URL] [--node N ...] [--top 5] [--json]

Without ``--block-service`` it asks the local cluster ``kvfleet up`` runs (its state file; with two
replicas, the leader its etcd names), else 127.0.0.1:50051.

Per node: used / cached / free by tier (device; host and disk: the committed blocks the node keeps
below its pool), the sequences (requests) holding the most blocks with their tenant and
age, the internal waste of partly filled last blocks; per tenant: blocks charged against the quota,
lower-tier blocks charged against the lower-tier cap, and refusals of each. It asks block_service
directly rather than the router: block_service holds
the page table, and the router's public Inference service has no operator call to proxy it through.
Each node's role (mixed, prefill, decode) and group (stable, canary, ...) come from its membership
record in etcd (``--etcd``, by default the local cluster's), when etcd answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable

from kvfleet.cli.cluster_certs import add_admin_flag, use_admin
from kvfleet.cli.cluster_state import ClusterState

DEFAULT_ADDRESS = "127.0.0.1:50051"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-service", default=None, metavar="ADDR",
                        help="block_service address (default: the leader of the local cluster `kvfleet up` runs, "
                             f"else {DEFAULT_ADDRESS})")
    parser.add_argument("--etcd", default=None, metavar="URL",
                        help="etcd, for the nodes' roles (default: the local cluster's; none: roles not shown)")
    parser.add_argument("--node", action="append", default=[], metavar="NODE", help="only this node (repeatable)")
    parser.add_argument("--top", type=int, default=5, metavar="K", help="top holders per node (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="give up after this long")
    add_admin_flag(parser)


def block_service_address(explicit: str | None, state: ClusterState | None,
                          leader_of: Callable[[str], str | None]) -> str:
    """Where to ask: ``--block-service``, else the local cluster's leader (``leader_of(etcd url)``;
    its first replica when etcd names none or cannot be read), else the default."""
    if explicit:
        return explicit
    if state is None or not state.block_service:
        return DEFAULT_ADDRESS
    if len(state.block_service) > 1 and state.etcd:
        try:
            leader = leader_of(state.etcd)
        except Exception:  # noqa: BLE001 - etcd down: a replica may still answer
            leader = None
        if leader:
            return leader
    return state.block_service[0]


def _etcd_leader(url: str) -> str | None:
    from kvfleet.core.leader import leader_address

    return asyncio.run(leader_address(url))


async def _fetch(args: argparse.Namespace, credentials):
    from kvfleet.block_service.client import BlockManagerClient

    async with BlockManagerClient(args.block_service, timeout_s=args.timeout_s) as client:
        report = await client.blocks(args.node, args.top)
    if args.etcd:
        report = with_roles(report, *await _roles(args.etcd, credentials))
    return report


def with_roles(report, roles: dict[str, str], groups: dict[str, str] | None = None):
    """``report`` with each node's role and group as etcd lists them (a node etcd does not list: none)."""
    from dataclasses import replace

    groups = groups or {}
    return replace(report, nodes=[replace(n, role=roles.get(n.stats.node_id, ""), group=groups.get(n.stats.node_id, ""))
                                  for n in report.nodes])


async def _roles(url: str, credentials) -> tuple[dict[str, str], dict[str, str]]:
    """Node id -> role, and node id -> group, from etcd's membership records; empty (one line on
    stderr) when etcd does not answer."""
    from kvfleet.core.backoff import error_line
    from kvfleet.core.membership import etcd_client, list_nodes

    try:
        async with etcd_client(url, timeout=5.0, credentials=credentials) as client:
            nodes, _ = await list_nodes(client)
    except Exception as e:  # the pools are the report; roles are a label on them
        print(f"kvfleet blocks: etcd at {url} did not answer ({error_line(e)}): roles not shown", file=sys.stderr)
        return {}, {}
    return ({node_id: info.role for node_id, info in nodes.items()},
            {node_id: info.group for node_id, info in nodes.items()})


def run(args: argparse.Namespace) -> int:
    import grpc

    from kvfleet.block_service.blocks_report import render, to_json
    from kvfleet.core.errors import BlockServiceError

    if args.top < 0:
        print("kvfleet blocks: --top must be 0 or more", file=sys.stderr)
        return 2
    state = ClusterState.read()
    try:
        credentials = use_admin(args.certs, state.certs if state is not None else None)
    except ValueError as err:
        print(f"kvfleet blocks: {err}", file=sys.stderr)
        return 2
    args.block_service = block_service_address(args.block_service, state, _etcd_leader)
    args.etcd = args.etcd or (state.etcd if state is not None else None)
    try:
        report = asyncio.run(_fetch(args, credentials))
    except grpc.aio.AioRpcError as err:
        print(f"kvfleet blocks: block_service at {args.block_service}: {err.code().name}: {err.details()}",
              file=sys.stderr)
        return 1
    except BlockServiceError as err:  # an unknown --node, or block_service unreachable
        print(f"kvfleet blocks: block_service at {args.block_service}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(report)) if args.json else render(report))
    return 0
