"""``kvfleet etcd-auth``: give etcd the fleet's users and roles and turn its auth on (an init step).

    kvfleet etcd-auth --etcd https://etcd:2379 --certs DIR/admin --nodes node-0,node-1

Run as admin (``--certs``: admin's certificate directory) against an etcd serving with
``--client-cert-auth``; the table of users and roles is ``kvfleet.cli.etcd_auth``'s. It only adds
and corrects, so it can run at every start: a node added later is one more run naming it
(``--nodes node-2``), and the nodes named before keep their users.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", required=True, metavar="URL", help="the etcd to set up (https://host:port)")
    parser.add_argument("--certs", required=True, metavar="DIR",
                        help="admin's certificate directory (ca.crt, tls.crt, tls.key; `kvfleet certs issue admin`)")
    parser.add_argument("--nodes", action="append", default=[], metavar="ID,ID",
                        help="compute node ids to give a user and a role (comma separated, repeatable)")
    parser.add_argument("--wait-s", type=float, default=30.0, metavar="S",
                        help="wait this long for etcd to answer (default 30)")


def node_ids(values: list[str]) -> list[str]:
    """``["node-0,node-1", "node-2"]`` -> the ids, each checked (ValueError, one line)."""
    from kvfleet.core.identity import Identity

    ids = [part.strip() for value in values for part in value.split(",") if part.strip()]
    for node_id in ids:
        Identity.node(node_id)
    return list(dict.fromkeys(ids))


def run(args: argparse.Namespace) -> int:
    import grpc

    from kvfleet.cli.etcd_auth import enable
    from kvfleet.core.identity import ADMIN_ID
    from kvfleet.core.tls import Credentials

    try:
        credentials = Credentials.load(args.certs, ADMIN_ID)
        applied = enable(args.etcd, credentials, node_ids(args.nodes), wait_s=args.wait_s)
    except ValueError as err:  # a setting, a node id, a URL, a certificate directory
        print(f"kvfleet etcd-auth: {err}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as err:
        print(f"kvfleet etcd-auth: etcd at {args.etcd}: {err.code().name}: {err.details()}", file=sys.stderr)
        return 2
    changes = [f"users added: {', '.join(applied.users_added)}" if applied.users_added else "",
               f"roles set: {', '.join(applied.roles_changed)}" if applied.roles_changed else "",
               "auth turned on" if applied.enabled_now else ""]
    print(f"etcd at {args.etcd}: {'; '.join(c for c in changes if c) or 'users and roles already as wanted'}")
    return 0
