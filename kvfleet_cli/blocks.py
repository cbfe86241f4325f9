"""``kvfleet blocks``: who holds the KV blocks, asked of block_service (read-only).

    kvfleet blocks --block-service 127.0.0.1:50051 [--node N ...] [--top 5] [--json]

Per node: used / cached / free by tier (device; host and disk: the committed blocks the node keeps
below its pool, issue 15), the sequences (requests) holding the most blocks with their tenant and
age, the internal waste of partly filled last blocks; per tenant: blocks charged against the quota,
lower-tier blocks charged against the lower-tier cap, and refusals of each. It asks block_service
directly rather than the router: block_service holds
the page table, and the router's public Inference service has no operator call to proxy it through.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-service", default="127.0.0.1:50051", metavar="ADDR",
                        help="block_service address (default 127.0.0.1:50051)")
    parser.add_argument("--node", action="append", default=[], metavar="NODE", help="only this node (repeatable)")
    parser.add_argument("--top", type=int, default=5, metavar="K", help="top holders per node (default 5)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="give up after this long")


async def _fetch(args: argparse.Namespace):
    from block_service.client import BlockManagerClient

    async with BlockManagerClient(args.block_service, timeout_s=args.timeout_s) as client:
        return await client.blocks(args.node, args.top)


def run(args: argparse.Namespace) -> int:
    import grpc

    from block_service.blocks_report import render, to_json
    from kvfleet.errors import BlockServiceError

    if args.top < 0:
        print("kvfleet blocks: --top must be 0 or more", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(_fetch(args))
    except grpc.aio.AioRpcError as err:
        print(f"kvfleet blocks: block_service at {args.block_service}: {err.code().name}: {err.details()}",
              file=sys.stderr)
        return 1
    except BlockServiceError as err:  # an unknown --node, or block_service unreachable
        print(f"kvfleet blocks: block_service at {args.block_service}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(report)) if args.json else render(report))
    return 0
