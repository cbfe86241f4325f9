"""The local cluster's compute nodes as settings: the defaults they take, and each one's
``kvfleet compute`` command line (``kvfleet.cli.local_cluster`` renders it with
``kvfleet.core.settings.to_argv``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvfleet.compute_service.engine.config import EngineConfig
from kvfleet.compute_service.node.settings import NodeCommand, NodeSettings
from kvfleet.core.roles import DECODE, MIXED, PREFILL

# The local cluster's defaults where they differ from a node's own: small blocks and a small pool, so
# that a laptop runs a few nodes side by side (``kvfleet up`` takes them as its flags' defaults).
LOCAL_NODE_DEFAULTS = {"block_size": 16, "kv_cache_memory": 64 << 20}


def local_node_settings(node: NodeSettings | None = None, **engine: object) -> NodeSettings:
    """Every node's settings in a local cluster: ``node`` (else the node defaults with
    ``LOCAL_NODE_DEFAULTS``), with the engine values given (None: not given) in place of its own."""
    base = node if node is not None else NodeSettings(engine=EngineConfig(**LOCAL_NODE_DEFAULTS))
    given = {name: value for name, value in engine.items() if value is not None}
    return replace(base, engine=replace(base.engine, **given)) if given else base


def node_roles(num_nodes: int, prefill: int = 0, decode: int = 0) -> dict[str, str]:
    """``node-<i>`` -> its role: the first ``prefill`` nodes prefill, the next ``decode`` decode,
    the rest mixed (``num_nodes`` at least their sum)."""
    if num_nodes < prefill + decode:
        raise ValueError(f"{num_nodes} nodes cannot hold {prefill} prefill and {decode} decode nodes")
    return {f"node-{i}": PREFILL if i < prefill else DECODE if i < prefill + decode else MIXED
            for i in range(num_nodes)}


def node_command(node: NodeSettings, model_dir: str, node_id: str, listen: str, etcd: str,
                 block_service: str | None, metrics_port: int | None, role: str = MIXED) -> NodeCommand:
    """Node ``node_id``'s command line: its place in the cluster and ``node``, with its disk KV tier
    in a directory of its own (``kv_disk_dir/<node id>``: a node wipes its tier's files at start)."""
    engine = node.engine
    if engine.kv_disk_dir is not None:
        node = replace(node, engine=replace(engine, kv_disk_dir=str(Path(engine.kv_disk_dir) / node_id)))
    return NodeCommand(model_dir, node_id, listen=listen, etcd=etcd, block_service=block_service,
                       metrics_port=metrics_port, role=role, settings=node)
