"""The tests' name for ``kvfleet.cli.node_direct``: requests written straight to one node's Serve
stream as the router writes them, and a node's metrics."""

from kvfleet.cli.node_direct import NodeAnswer, generate_on, metric, node_metrics, run_on

__all__ = ["NodeAnswer", "generate_on", "metric", "node_metrics", "run_on"]
