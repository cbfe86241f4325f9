"""``kvfleet compute``: one compute node's command line, its checks before the model loads, and its
run (the life itself, start to drained exit, is ``kvfleet.compute_service.node.lifecycle``).

A node outlives its peers' trouble: started while block_service is down, it waits for it; when
block_service goes away later, requests that need it wait (or move to another node) and the node
resyncs its pool when it is back; when etcd loses the node's lease, the registration takes a new
one and the pool is synced again. Only its own engine thread dying ends it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvfleet.compute_service.node.lifecycle import serve
from kvfleet.compute_service.node.settings import NodeCommand
from kvfleet.core import settings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_flags(parser, NodeCommand)


def preflight(command: NodeCommand) -> None:
    """What a person can get wrong beyond a setting's own rule, answered before the model loads:
    FP8 where this torch and device cannot hold it, a device torch does not know, the port, the
    model directory, the peers' addresses (waited for a while: they may be starting too)."""
    import torch

    from kvfleet.compute_service.kv.pool import kv_cache_dtype
    from kvfleet.compute_service.model.config import ModelConfig
    from kvfleet.compute_service.node import warm_start
    from kvfleet.core.leader import FROM_ETCD
    from kvfleet.core.preflight import PreflightError, check_port_free, check_side_ports_free, wait_reachable

    engine = command.settings.engine
    try:
        kv_cache_dtype(engine.kv_cache_dtype, engine.dtype, torch.device(engine.device))
    except (ValueError, RuntimeError) as e:  # RuntimeError: a device torch cannot use
        raise PreflightError(str(e)) from None
    check_port_free(command.listen)
    check_side_ports_free(command.listen, command.metrics_port, command.health_port)
    ModelConfig.from_dir(command.model)
    warm_start.preflight(command.settings.warm_start)
    if command.etcd:
        wait_reachable("etcd", command.etcd, command.dependency_timeout, log.warning)
    if command.block_service == FROM_ETCD and not command.etcd:
        raise PreflightError("--block-service etcd needs --etcd: the block_service leader is elected there")
    if command.block_service and command.block_service != FROM_ETCD:
        wait_reachable("block_service", command.block_service, command.dependency_timeout, log.warning)


def run(args: argparse.Namespace) -> int:
    from kvfleet.compute_service.model.config import ModelLoadError
    from kvfleet.compute_service.node import mem_probe
    from kvfleet.core import event_loop, tls
    from kvfleet.core.identity import Identity
    from kvfleet.core.preflight import PreflightError
    from kvfleet.core.tracing import setup_tracing, shutdown_tracing

    try:
        command = settings.build(NodeCommand, args)
        identity = Identity.node(command.node_id) if command.tls.certs else None  # its certificate must name it
        tls.configure(command.tls, identity, f"node {command.node_id}")
    except ValueError as e:  # a setting's rule, or one between settings (the KV tiers)
        print(f"kvfleet compute: {e}", file=sys.stderr)
        return 2
    mem_probe.start_if_asked(command.node_id)  # a diagnostic, off unless KVFLEET_MEM_PROBE is set
    try:
        preflight(command)
    except (PreflightError, ModelLoadError) as e:
        print(f"kvfleet compute: {e}", file=sys.stderr)
        return 2
    setup_tracing("kvfleet-compute")
    try:
        event_loop.run(serve(command))
    except (ModelLoadError, PreflightError) as e:  # found while loading the weights or sizing the pool
        print(f"kvfleet compute: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown_tracing()
    return 0
