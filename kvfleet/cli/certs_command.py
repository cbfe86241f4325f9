"""``kvfleet certs``: the cluster CA and its certificates (``kvfleet.core.certs``), for deployments.

    kvfleet certs init DIR                                   the CA in DIR/ca (kept if there)
    kvfleet certs issue NAME --dir DIR [--host H]... [--days N] [--force]
    kvfleet certs show DIR                                   each identity, its expiry

NAME is ``router``, ``block-service``, ``admin``, ``etcd`` or ``node:<id>``; the certificate goes to
``DIR/<stem>/`` (ca.crt, tls.crt, tls.key; keys 0600) for the service's ``--certs``. ``kvfleet up``
makes its own under its state directory; nothing here replaces a file unless ``--force``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="certs_command", required=True, metavar="ACTION")
    init = sub.add_parser("init", help="make the cluster CA in DIR/ca (kept if there)")
    init.add_argument("dir", metavar="DIR")
    init.add_argument("--days", type=int, default=3650, help="the CA's validity (default 3650)")
    issue = sub.add_parser("issue", help="issue an identity's certificate into DIR/<stem>/")
    issue.add_argument("name", metavar="NAME", help="router, block-service, admin, etcd or node:<id>")
    issue.add_argument("--dir", required=True, help="the certificates directory (its ca/ holds the CA)")
    issue.add_argument("--host", action="append", default=[], metavar="HOST",
                       help="another DNS name or IP the service is reached at (repeatable)")
    issue.add_argument("--days", type=float, default=365, help="validity (default 365)")
    issue.add_argument("--force", action="store_true", help="replace an existing certificate and key")
    show = sub.add_parser("show", help="each identity under DIR and when its certificate expires")
    show.add_argument("dir", metavar="DIR")


def run(args: argparse.Namespace) -> int:
    from kvfleet.core import certs
    from kvfleet.core.identity import Identity

    try:
        if args.certs_command == "init":
            made = certs.init_ca(args.dir, days=args.days)
            print(f"{'made' if made else 'kept'} the cluster CA in {certs.ca_dir(args.dir)}")
        elif args.certs_command == "issue":
            identity = Identity.parse(args.name)
            target = certs.identity_dir(args.dir, identity)
            existed = (target / certs.CERT_FILE).exists()
            out = certs.issue(args.dir, identity, args.host, days=args.days, force=args.force)
            print(f"kept {out} (--force to replace)" if existed and not args.force else f"issued {identity} into {out}")
        else:
            _show(Path(args.dir))
    except (ValueError, OSError) as err:  # CertError is a ValueError
        print(f"kvfleet certs: {err}", file=sys.stderr)
        return 2
    return 0


def _show(directory: Path) -> None:
    from kvfleet.core import certs

    found = sorted(p for p in directory.glob(f"*/{certs.CERT_FILE}"))
    if not found:
        raise ValueError(f"no certificates under {directory}")
    for path in found:
        info = certs.info(path.read_bytes())
        days = info.seconds_left() / 86400
        state = f"expires {info.not_after:%Y-%m-%d} ({days:.0f} days)" if days > 0 else "EXPIRED"
        print(f"{str(info.identity or '?'):24} {path.parent}  {state}")
