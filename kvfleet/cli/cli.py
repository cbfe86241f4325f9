"""The ``kvfleet`` command line. Each subcommand lives in its own module, which provides
``add_arguments(parser)`` and ``run(args) -> int``; this file only lists them."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvfleet.core import parent_death

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "make-model": ("kvfleet.cli.model_maker", "write a seeded random Llama-style model directory"),
    "demo": ("kvfleet.cli.demo", "run the demo: a local cluster serving two tenants (or --in-process), streamed"),
    "block-service": ("kvfleet.block_service.main", "run block_service: the fleet's page table, quotas, durable log"),
    "checkpoint": ("kvfleet.block_service.checkpoint",
                   "check block_service snapshots, logs and backups (verify PATH), or restore a backup"),
    "blocks": ("kvfleet.cli.blocks", "who holds the KV blocks: per node tiers, top holders, waste; tenants"),
    "compute": ("kvfleet.compute_service.node.main", "run a compute node: model, KV pool, Compute service, etcd membership"),
    "router": ("kvfleet.router.main", "run the router: the public Inference service, queueing and KV-aware routing"),
    "generate": ("kvfleet.cli.generate_client", "send a prompt to the router and stream the answer"),
    "plan": ("kvfleet.cli.plan_command", "size the KV cache and the hardware for a model, a device and a context"),
    "bench": ("kvfleet.cli.bench_command", "stress a router in three phases (fixed, mixed, soak): latency, "
              "throughput, KV usage; JSON, CSV and plots"),
    "tune": ("kvfleet.cli.tune_command", "search the block size for the most throughput under a latency SLO, "
             "each candidate on a fresh local cluster"),
    "up": ("kvfleet.cli.up", "run a local cluster until Ctrl-C, restarting any of its processes that dies"),
    "convert-gguf": ("kvfleet.cli.convert_gguf", "convert a GGUF file into a Hugging Face model directory"),
    "certs": ("kvfleet.cli.certs_command", "the cluster CA and the services' certificates for mutual TLS: "
              "init, issue NAME, show"),
    "etcd-auth": ("kvfleet.cli.etcd_auth_command", "give etcd the fleet's users and roles (a node writes only "
                  "its own key) and turn its client-certificate auth on"),
    "canary": ("kvfleet.cli.canary_command", "a share of new conversations on the canary group: start, stop, "
               "report (bootstrap verdicts per metric), promote, rollback"),
    "models": ("kvfleet.cli.models_pull", "named models: `models pull smollm2` downloads and converts one"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Only the module of the command named in ``argv`` is imported (the others may be heavy)."""
    parser = argparse.ArgumentParser(prog="kvfleet", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((arg for arg in argv if arg in COMMANDS), None)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(_module=module, _parser=command)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line, read. A command that reads its flags from a file (``up --config``) gives
    the file's values through ``file_defaults(args)``; they become the defaults and the command line
    is read again, so that a flag given still wins. ``ValueError`` (one line) for a bad file."""
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    file_defaults = getattr(args._module, "file_defaults", None)
    if file_defaults is not None and (defaults := file_defaults(args)):
        args._parser.set_defaults(**defaults)
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> int:
    parent_death.arm()  # started by `kvfleet up` or a test: die with it
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"kvfleet {next((a for a in argv if a in COMMANDS), '')}: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
